"""The OpenAI-compatible HTTP server behind ``aphrodite serve``.

``server.build_app`` makes the FastAPI application around one engine and ``server.run_server``
serves it with uvicorn; ``protocol`` holds the request and response bodies, ``async_engine`` the
background engine loop that every HTTP request shares, and ``metrics`` the Prometheus metrics and
the periodic statistics log.
"""
