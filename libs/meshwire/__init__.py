"""meshwire: the wire library every meshnet service shares.

Modules, one concept each (none imports a web framework):

- :mod:`meshwire.headers`  ``X-Meshnet-*`` header names and ``WIRE_VERSION``
- :mod:`meshwire.limits`   named bounds shared by every service
- :mod:`meshwire.errors`   the OpenAI error body
- :mod:`meshwire.auth`     shared-secret bearer check
- :mod:`meshwire.fields`   bounded field types for pydantic models
- :mod:`meshwire.frames`   activation frames: encode, decode, refuse (imports torch)
- :mod:`meshwire.routes`   routes and their HMAC-signed tokens
- :mod:`meshwire.registry` tracker registration / heartbeat body
- :mod:`meshwire.openai`   OpenAI request / response / chunk schemas (a package: one module a concept,
  every name re-exported by its ``__init__``)
- :mod:`meshwire.sse`      server-sent events framing
- :mod:`meshwire.envelope` relay JSON envelope and binary mux codec
- :mod:`meshwire.logs`     logging setup shared by the services
- :mod:`meshwire.exposure` no service beyond loopback with an empty or published secret
- :mod:`meshwire.tls`      certificate settings for servers, verifying contexts for clients
- :mod:`meshwire.body_guard` a deadline (and a cap) on request bodies, as plain ASGI middleware
- :mod:`meshwire.slow_clients` uvicorn's HTTP protocol with a request-head deadline and a bound
  on connections per address (the one module that imports uvicorn, when it is used)
- :mod:`meshwire.serving`  what every service serves with: the settings mixins of those guards and TLS
  (one block, inherited by the four services' settings), and the options it passes uvicorn
- :mod:`meshwire.targets`  addresses no service may be made to call (metadata, link-local; private by choice)
- :mod:`meshwire.rank_proof` signed bootstrap registrations (a prefill rank's slot held by its key)
- :mod:`meshwire.kv_box`   a KV pull's answer sealed to the puller's fresh X25519 key

Import the submodule you need; this package imports nothing eagerly so that
torch-free services (tracker, relay) do not pay for torch.
"""
