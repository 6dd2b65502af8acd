"""The PD bootstrap registry: where prefill ranks publish their addresses and decode ranks find them.

Behaviour: ``reference/bootstrap-spec.md``, rule by rule (the reference is a
Rust server, ``reference/bootstrap.rs.txt``). Modules, one concept each:

* :mod:`.registry`: the table and every rule of ``PUT``/``GET /route`` (no HTTP);
* :mod:`.layout`: the cache layout contract and stage placement checks;
* :mod:`.integers`: integers and division exactly as the reference reads them;
* :mod:`.refusals`: the refusal exception and the reference's texts;
* :mod:`.metrics`: Prometheus collectors and their middleware;
* :mod:`.app`: ``create_app(settings)``, the routes;
* :mod:`.settings`: ``BootstrapSettings`` (``MESHNET_*``);
* :mod:`.server`: ``serve(settings)`` (``meshnet bootstrap``) and ``BootstrapServer`` (on a thread).

Every body is read under a byte cap and a deadline (:mod:`meshwire.body_guard`),
every request head under a deadline, and connections are bounded per address
(:mod:`meshwire.slow_clients`), as in the other services.

Workers reach the service with :mod:`meshwire.bootstrap_client`.
"""
