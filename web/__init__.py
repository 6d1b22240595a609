"""The browser UI: a Gradio page served beside the assistant's APIs, a client of its Realtime API.

``python -m web`` starts it; :mod:`web.app` is the page.
"""
