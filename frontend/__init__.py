"""The frontend process: the ways in (HTTP, Engine, RPC, Ray), tokenize/detokenize, request state and streaming, the
adapter registry, and the child processes behind it.

Module map:
    generate.py          GenerateService: every way in's operations without HTTP; says once whether the server is up
    request_table.py     RequestTable: the requests in flight (routed, counted, freed on every path), token deltas in
    request_state.py     RequestState: one request as the frontend sees it — token ids in, text out, finish reason
    runtime.py           Runtime: start the child processes, own the pieces, watch, drain, fail whole, shut down
    server_info.py       /server_info: the configuration and live counters, the frontend's and each replica's
    params.py            request bodies: the native API's strict schemas, the field types the OpenAI bodies share
    bodies.py            response bodies of the HTTP routes (/openapi.json's schemas)
    errors.py            the frontend's typed errors (unavailable, invalid input, rate limited)
    caller.py            who sent the request being handled: its API key, by id
    rate_limits.py       KeyRateLimits: requests and tokens per minute per API key
    detokenizer.py       incremental detokenization (UTF-8 safe) and stop strings
    chat_template.py     a chat's prompt: messages and tools through the chat template
    constraints.py       structured-output fields of both APIs -> one OutputConstraint
    grammar_checker.py   GrammarChecker: a constraint compiles, within bounds, before its request is admitted
    reasoning.py         reasoning parsers: `<think>` text goes to reasoning_content
    harmony.py           gpt-oss's harmony output read as channel messages (its reasoning and tool-call parsers)
    metrics.py           Metrics: the Prometheus series of one server
    pooling.py           PoolingService: embeddings, scores and classes from the pooling runner (prompts, pairs)
    model_files.py       the model's local files, downloaded from the Hub when need be
    lora_config.py       the LoRA part of the config completed before the workers start
    demo.py              where the built-in demo model and its adapters live
    entrypoints/         the ways in: HTTP app and routes, Engine, RPC server and client, Ray Serve, CLI, headless node
    openai/              the OpenAI APIs without HTTP: bodies, a request from its body to its answer, whole or streamed
    tools/               tool calling: the request's tools, the parsers that find calls, the grammar that forces one
    multimodal/          images in requests: sources, checks, the model's image processor, placeholders; see its map
    adapters/            the adapter registry, its operations, host-copy residency, files and sources; see its map
    cluster/             the child processes, scheduler sockets, data-parallel replicas and routing, the nodes
"""
