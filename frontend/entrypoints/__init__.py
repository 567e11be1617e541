"""The ways in: the HTTP app and its routes, the in-process Engine, the RPC server and client, Ray Serve, the CLI,
and a headless node. The only package of frontend/ that knows aiohttp, Ray or argv."""
