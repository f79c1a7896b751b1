"""``subspec serve``: an OpenAI-compatible HTTP server and a web chat page over one :class:`~subspec.runtime.Runtime`.

- :mod:`~subspec.server.app`: the FastAPI app (endpoints, errors in OpenAI's JSON shape, SSE streaming, the page).
- :mod:`~subspec.server.jobs`: the engine worker thread and its bounded FIFO queue (batch 1, cancel per round).
- :mod:`~subspec.server.schema`: request bodies, validated strictly. :mod:`~subspec.server.stops`: stop strings.
- :mod:`~subspec.server.metrics`: Prometheus metrics. ``static/``: the chat page (plain HTML/CSS/JS, no build).
"""
