"""The tracker: node registry, route planner, and the OpenAI front door.

Modules, one concept each: ``settings`` (configuration), ``registry`` (nodes,
leases, states, backoffs; pure), ``planner`` (routes over layer ranges; pure),
``state`` (one tracker's state and its route/model questions), ``responses``
(errors, bounded bodies, credentials), ``proxy`` (forwarding to a head node),
``openai_api`` and ``mesh_api`` (the routes), ``metrics``, ``app``
(``create_app``) and ``server`` (``meshnet tracker``).
"""
