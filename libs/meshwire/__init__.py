"""meshwire: the wire library every meshnet service shares (frames, routes, signing, schemas)."""
