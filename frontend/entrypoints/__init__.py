"""The ways in: the HTTP app and its routes, the in-process Engine, the RPC server and client, Ray Serve, the CLI,
and a headless node. The only package of frontend/ that knows aiohttp, Ray or argv.

launch.py         `loraplex [serve MODEL]` / scripts/launch_server.py: parse flags, start the server
cli.py            the command line, generated from ServerConfig's fields and their help; vLLM's and SGLang's spellings
foreign_flags.py  vLLM's and SGLang's flags with no setting here: accepted where already done, else refused by name
http_server.py    the aiohttp application: routes, API keys, every failure mapped to a status and a message
http_utils.py     small aiohttp helpers the routes share: the app's Runtime and GenerateService, JSON errors, SSE
wire.py           what the aiohttp app and the Ray replica answer alike: JSON, Server-Sent Events, failures
native_api.py     native, SGLang-compatible routes: /generate, adapters, abort, health and info
openai_api.py     OpenAI-compatible routes: completions, chat, models, adapter load/unload
pooling_api.py    the pooling runner's routes: /v1/embeddings, /pooling, /score, /rerank (v1, v2), /classify
responses_api.py  POST /v1/responses
utility_api.py    /tokenize, /detokenize, /tokenizer_info, /version, /ping, /health_generate
openapi.py        GET /openapi.json, its schemas generated from the routes' Structs
console_api.py    the web console's page and static files
engine.py         Engine: the same processes as the server, driven in-process without HTTP
rpc_server.py     RpcServer: the internal RPC endpoint (--rpc-addr) over a ZeroMQ ROUTER socket
rpc_client.py     RpcClient: call that endpoint from Python
ray_serve.py      Ray Serve: an OpenAI-compatible ingress in front of replicas that each wrap an Engine
headless.py       a headless node (--nnodes > 1, --node-rank > 0): its ranks and its own /health
"""
