"""The four meshnet services: tracker, node, relay, bootstrap."""
