"""The OpenAI APIs without HTTP: request bodies, and one completions, chat or Responses request from its body to its
answer, whole or streamed. The routes (entrypoints/openai_api.py, responses_api.py) and the Ray replica call it;
nothing here imports entrypoints/.

schemas.py            the request bodies: completions, chat, Responses, vLLM's adapter and tokenize routes
pooling_schemas.py    the pooling routes' request bodies (embeddings, score, rerank, classify)
serving.py            a request's sampling, its choices submitted (start_openai); OpenAIRun: its answer; model cards
writers.py            ChoiceCursor: what of one choice went out; ChatWriter, CompletionWriter: chunks or whole answer
logprobs.py           completions' and chat's logprobs, vLLM's prompt_logprobs
responses.py          POST /v1/responses: input items as chat messages, a forced call as a constraint; ResponsesRun
responses_schemas.py  the Response object and its streamed events
responses_events.py   each output item's events (EventWriter); the items a tool-call parser reads (ParsedItemsStream)
"""
