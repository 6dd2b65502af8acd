"""The HTTP endpoints a node answers (the top wing under the root): OpenAI on a head, frames between hops,
the prefill side of a KV handoff. May import every wing below it; see ``services.node``'s map.
"""
