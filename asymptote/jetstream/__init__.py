"""NATS JetStream, as every service uses it.

- :mod:`~asymptote.jetstream.names`: every stream, subject, consumer and
  bucket of a run, and their declarations.
- :mod:`~asymptote.jetstream.connect`: connecting (credentials, TLS, waiting
  for the server).
- :mod:`~asymptote.jetstream.publish` and :mod:`~asymptote.jetstream.pull`:
  the lean publish and fetch paths of hot loops.
- :mod:`~asymptote.jetstream.deadletter`: setting bad input aside.
- :mod:`~asymptote.jetstream.internals`: the only code that reads nats-py's
  private attributes.

What a message's payload must hold is :mod:`asymptote.messages`' business.
"""
