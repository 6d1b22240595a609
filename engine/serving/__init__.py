"""The engine over HTTP: OpenAI-compatible routes (``server``), their request and response
schemas (``openai_protocol``), Prometheus metrics (``prometheus``) and the command line (``cli``,
run as ``python -m engine.serving``)."""
