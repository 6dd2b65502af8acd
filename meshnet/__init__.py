"""meshnet: the command line that starts and talks to a mesh."""
