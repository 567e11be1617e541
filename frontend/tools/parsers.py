"""The tool-call parsers by their `--tool-call-parser` names (vLLM's; protocol/config.py maps SGLang's onto them)."""

from __future__ import annotations

from loraplex.frontend.tools.base import ToolParser
from loraplex.frontend.tools.deepseek import DeepSeekV3Parser
from loraplex.frontend.tools.glm45 import Glm45Parser
from loraplex.frontend.tools.harmony import HarmonyParser
from loraplex.frontend.tools.hermes import HermesParser
from loraplex.frontend.tools.kimi import KimiK2Parser
from loraplex.frontend.tools.llama3_json import Llama3JsonParser
from loraplex.frontend.tools.mistral import MistralParser
from loraplex.frontend.tools.pythonic import PythonicParser
from loraplex.frontend.tools.xml import XmlParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "qwen3_coder": XmlParser,
    "xml": XmlParser,
    "pythonic": PythonicParser,
    "llama4_pythonic": PythonicParser,  # Llama 4 writes the list between `<|python_start|>` and `<|python_end|>`
    "glm45": Glm45Parser,
    "openai": HarmonyParser,
    "deepseek_v3": DeepSeekV3Parser,
    "kimi_k2": KimiK2Parser,
}
