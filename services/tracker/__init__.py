"""The tracker: node registry, route planner, and the OpenAI front door.

Modules, one concept each (``docs/architecture.md`` draws the same map):

- wiring: ``app`` (``create_app``: routers, middleware, lifespan), ``server`` (``meshnet tracker``),
  ``settings`` (configuration), ``metrics``, ``responses`` (errors, bounded bodies, credentials),
  ``error_answers`` (every error in the OpenAI shape, each kind handled once);
- routes: ``service_api`` (health, metrics, page), ``openai_api`` (the front door), ``mesh_api``
  (registration, routes, views), ``admin_api`` (keys, join tokens, the operator's API);
- a request's way to a head: ``forwarding`` (one path per kind of answer), ``route_lease`` (its load on
  its route and its open answer, ended once), ``proxy`` and ``head_answers`` (asking a head, what of its
  answer is relayed), ``continuation`` and ``collect`` (a stream that outlives its head, assembled),
  ``choices`` (``n > 1``);
- state: ``state`` (one tracker's state and its route/model questions), ``registry`` (nodes, leases,
  states, backoffs; pure) and ``node_views`` (what it shows), ``planner`` and ``pd_routes`` (routes over
  layer ranges; pure), ``store/`` (where the registry lives: memory or Redis), ``store_fence`` and
  ``key_limits`` (middleware), ``trust``, ``keyring`` and ``join_tokens`` (route keys, node credentials);
- placement: ``placement`` and ``placement_rebalance`` (where a node without ``--layers`` serves, and healing
  plans that re-cut live nodes; pure), ``placement_api`` (``POST /v1/placement``), ``healing`` (the placement
  book and a heartbeat's move), ``placement_view`` (what ``GET /v1/nodes`` shows of placement).
"""
