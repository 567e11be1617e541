"""The OpenAI APIs without HTTP: request bodies, and one completions, chat or Responses request from its body to its
answer, whole or streamed. The routes (entrypoints/openai_api.py, responses_api.py) and the Ray replica call it;
nothing here imports entrypoints/.

schemas.py            the request bodies: completions, chat, Responses, vLLM's adapter and tokenize routes
serving.py            sampling and logprobs of a request; OpenAIRun: its choices, whole or as stream chunks; model cards
responses.py          POST /v1/responses: input items as chat messages, a forced call as a constraint; ResponsesRun
responses_schemas.py  the Response object and its streamed events
responses_events.py   each output item's events (EventWriter); the items a tool-call parser reads (ParsedItemsStream)
"""
