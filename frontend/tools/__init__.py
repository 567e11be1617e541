"""Tool calling on the chat route: the request's tools and tool_choice, the parsers that find calls in a model's
text (one-shot and streamed), and the grammar that forces a call.

request.py      a chat request's tools, tool_choice and parallel_tool_calls, and what they mean for its output
base.py         what every parser shares: a call's shape, content and calls split apart
parsers.py      the parsers by their --tool-call-parser names
stream.py       one choice's tool calls, whole (tool_answer) or streamed (ToolCallStream)
forced.py       tool_choice `required` or a named function: a JSON-schema grammar forces the output
json_calls.py   calls written as JSON objects (hermes, llama3_json, mistral), or as a head then one (HeadedParser)
hermes.py       Hermes / Qwen2.5: `<tool_call>{...}</tool_call>`
llama3_json.py  Llama 3.1-3.3 JSON calls
mistral.py      Mistral: `[TOOL_CALLS] [...]`
pythonic.py     Pythonic calls: `[f(a=1), g(b="x")]` (pythonic, llama4_pythonic)
xml.py          Qwen3-Coder's XML calls
glm45.py        GLM-4.5 / 4.6: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`
deepseek.py     DeepSeek-V3 / V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}` (V3: a fenced block after the name)
kimi.py         Kimi K2: `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}`, the id kept
harmony.py      gpt-oss (`openai`): harmony messages `<|channel|>commentary to=functions.NAME ...<|message|>{...}`
"""
