"""Tool calling on the chat route: the request's tools and tool_choice, the parsers that find calls in a model's
text (one-shot and streamed), and the grammar that forces a call."""
