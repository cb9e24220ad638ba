"""The ingress: a raw ASGI app run by granian workers."""
