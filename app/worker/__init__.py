"""The engine's side of the app: everything that touches the models runs on one thread.

- ``messages``: the dataclasses that cross between the GUI thread and the engine's thread;
- ``loading``: opening models, timing plain decoding, checking drafts' compatibility;
- ``replying``: one reply (prompt, steps, settings changed mid-reply, streamed text);
- ``racing``: plain decoding against the speculation on the same prompt;
- ``thread``: ``EngineWorker``, the QObject on its own QThread that owns the engine and emits
  the signals, and ``EngineController``, the GUI thread's handle on it.
"""
