"""The local OpenAI-compatible HTTP server: ``staged-chat serve`` and the app's Local server.

No Qt here: the same parts serve from the command line and from the window.

- ``requests``: an OpenAI request body checked field by field into a ``GenerationRequest``;
- ``errors``: ``ApiError``, a refusal in OpenAI's error shape;
- ``jobs``: what crosses to the thread that owns the engine (a ``Job``, its events) and
  ``run_job``, which decodes one request there;
- ``engine_thread``: that thread for ``staged-chat serve`` (the app's is its ``EngineWorker``);
- ``responses``: responses, streamed chunks and the ``speculation`` object;
- ``admission``: the bounded queue of requests and the counts the app shows;
- ``http``: the ASGI application (Starlette): routes, guards, streaming, disconnects;
- ``running``: binding the socket and running uvicorn, in the foreground or on a thread.
"""
