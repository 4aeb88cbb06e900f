"""Code shared by the API and the workers: settings, wire protocol, Redis keys, SQL tables."""
