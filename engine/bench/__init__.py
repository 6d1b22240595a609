"""Benchmarks and developer tools for the engine, each figure next to a ceiling or a baseline.

``python -m engine.bench`` (``cli``) runs the suites: ``latency``, ``prefill``, ``throughput``,
``prefix``, ``chunked``, on the workloads of ``workload``, against the ceilings of ``ceilings``,
checked first against HF (``correctness``, ``hf_reference``) and printed by ``report``;
``python -m engine.bench serve`` is the load generator for any OpenAI-compatible server
(``serve``); ``python -m engine.bench.kernels`` times the attention and GEMV kernels alone;
``sync_debug`` finds where the host waits for the device.
"""
