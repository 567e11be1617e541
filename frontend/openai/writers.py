"""Chat's and completions' answers from their choices' states. Each choice has a cursor (what of its output went out);
a writer reads the cursor's next piece and shapes it: as stream chunks while the choice grows, or, read once from a
fresh cursor over the finished state, as the whole answer. So the two forms come from one reading of the output."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from loraplex.frontend.bodies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    PromptLogprobs,
    PromptTokensDetails,
    Usage,
)
from loraplex.frontend.openai.logprobs import Echo, chat_logprobs, completion_logprobs, prompt_logprobs
from loraplex.frontend.openai.schemas import CommonParams
from loraplex.frontend.reasoning import Reasoning, ReasoningParser
from loraplex.frontend.request_state import RequestState
from loraplex.frontend.tools.request import ToolPlan
from loraplex.frontend.tools.stream import ToolCallStream, tool_answer


def finish_reason(state: RequestState) -> str | None:
    if state.finish_reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(state.finish_reason["type"], "abort")


def usage(states: list[RequestState], num_prompt_tokens: int, n: int) -> Usage:
    """num_prompt_tokens: the request's prompts, each counted once (OpenAI, vLLM and SGLang do not count it n times);
    so are their cached tokens, as the first of each prompt's n choices found them (states hold n per prompt)."""
    completion = sum(len(s.output_ids) for s in states)  # so far, in a stream with continuous_usage_stats
    cached = sum(s.num_cached_prompt_tokens for s in states[::n])
    return Usage(
        prompt_tokens=num_prompt_tokens, completion_tokens=completion, total_tokens=num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


class Piece(NamedTuple):
    """What a choice's state added since its cursor last read it."""

    text: str  # the answer's text (its reasoning left out)
    reasoning: str  # --reasoning-parser: the <think> text
    logprobs_start: int  # the first output token whose logprobs had not gone out
    has_logprobs: bool  # logprobs were asked and new ones came
    token_ids: list[int]
    finish_reason: str | None


class ChoiceCursor:
    """One choice's place in its output: how much of its text, logprobs and token ids went out, its reasoning split
    as the text arrives, its tool calls as they parse, and whether its first piece (echo, prompt ids) went out."""

    def __init__(self, index: int, echo: Echo | None = None, reasoning: ReasoningParser | None = None,
                 tools: ToolCallStream | None = None):
        self.index = index
        self.echo = echo  # completions with echo: the prompt goes before the choice's first piece
        self.reasoning = reasoning
        self.tools = tools
        self.num_chars = 0
        self.num_logprobs = 0
        self.num_ids = 0
        self.answer = ""  # with tool calls: the answer so far, its reasoning left out
        self.is_open = False  # a piece went out

    def advance(self, state: RequestState) -> Piece:
        text = state.text[self.num_chars :]
        self.num_chars = len(state.text)
        reason = finish_reason(state)
        reasoning = ""
        if self.reasoning is not None:  # a partial tag waits for the next piece; the last piece releases it
            reasoning, text = self.reasoning.feed(text)
            if reason is not None:
                rest_reasoning, rest_text = self.reasoning.flush()
                reasoning, text = reasoning + rest_reasoning, text + rest_text
        start, self.num_logprobs = self.num_logprobs, len(state.output_logprobs)
        token_ids, self.num_ids = state.output_ids[self.num_ids :], len(state.output_ids)
        return Piece(text, reasoning, start, state.wants_logprobs and self.num_logprobs > start, token_ids, reason)

    def open(self) -> bool:
        """Whether the piece going out is the choice's first."""
        first, self.is_open = not self.is_open, True
        return first


class Writer:
    """What both writers share: the answer's id fields, its states and usage, and the request's output options."""

    def __init__(self, base: dict, states: list[RequestState], num_prompt_tokens: int, req: CommonParams,
                 num_prompt_top: int | None):
        self.base = base  # id, created, model
        self.states = states
        self.num_prompt_tokens = num_prompt_tokens  # each prompt once, however many choices share it (n)
        self.n = req.n
        self.return_ids = bool(req.return_token_ids)
        self.num_prompt_top = num_prompt_top  # vLLM's prompt_logprobs: alternatives per prompt token, or None
        options = req.stream_options
        self.include_usage = options is not None and options.include_usage
        # vLLM's continuous_usage_stats: with include_usage, the usage so far in every chunk too
        self.continuous = self.include_usage and options.continuous_usage_stats

    def usage(self) -> Usage:
        return usage(self.states, self.num_prompt_tokens, self.n)

    def ids(self, token_ids: list[int]) -> list[int] | None:
        return list(token_ids) if self.return_ids else None

    def prompt_logprobs(self, state: RequestState) -> PromptLogprobs | None:
        return None if self.num_prompt_top is None else prompt_logprobs(state, self.num_prompt_top)

    def chunk_usage(self, usage_: Usage | None) -> Usage | None:
        return self.usage() if self.continuous and usage_ is None else usage_

    def is_empty(self, piece: Piece) -> bool:
        """Nothing to send: a stream chunk would carry no text, logprobs, ids or finish."""
        return (not piece.text and not piece.reasoning and piece.finish_reason is None and not piece.has_logprobs
                and not (self.return_ids and piece.token_ids))


class CompletionWriter(Writer):
    def __init__(self, base: dict, states: list[RequestState], num_prompt_tokens: int, req: CommonParams,
                 num_prompt_top: int | None, echoes: list[Echo] | None):
        super().__init__(base, states, num_prompt_tokens, req, num_prompt_top)
        self.echoes = echoes  # with echo: each choice's prompt, its text put before the choice's

    def cursor(self, index: int) -> ChoiceCursor:
        return ChoiceCursor(index, echo=self.echoes[index] if self.echoes else None)

    def choice(self, cursor: ChoiceCursor, state: RequestState, piece: Piece) -> CompletionChoice:
        """A piece as a choice: a stream chunk's, or from a fresh cursor the whole choice. The first piece carries
        the echoed prompt (and its logprobs) and, with return_token_ids, the prompt's ids."""
        first = cursor.open()
        with_prompt = first and cursor.echo is not None
        logprobs = None
        if state.wants_logprobs:
            logprobs = completion_logprobs(state, piece.logprobs_start, cursor.echo, with_prompt)
        return CompletionChoice(index=cursor.index, text=cursor.echo.text + piece.text if with_prompt else piece.text,
                                logprobs=logprobs, finish_reason=piece.finish_reason,
                                prompt_token_ids=state.prompt_ids if first and self.return_ids else None,
                                token_ids=self.ids(piece.token_ids))

    def response(self) -> CompletionResponse:
        choices = []
        for i, state in enumerate(self.states):
            cursor = self.cursor(i)
            choice = self.choice(cursor, state, cursor.advance(state))
            choice.prompt_logprobs = self.prompt_logprobs(state)
            choices.append(choice)
        return CompletionResponse(**self.base, object="text_completion", choices=choices, usage=self.usage())

    def opening(self) -> Iterator[CompletionChunk]:
        return iter(())

    def stream_choices(self, cursor: ChoiceCursor, state: RequestState) -> list[CompletionChoice]:
        piece = cursor.advance(state)
        return [] if self.is_empty(piece) else [self.choice(cursor, state, piece)]

    def chunk(self, choices: list, usage_: Usage | None = None) -> CompletionChunk:
        return CompletionChunk(**self.base, object="text_completion", choices=choices, usage=self.chunk_usage(usage_))


class ChatWriter(Writer):
    def __init__(self, base: dict, states: list[RequestState], num_prompt_tokens: int, req: CommonParams,
                 num_prompt_top: int | None, reasoning: Reasoning | None, tools: ToolPlan | None):
        super().__init__(base, states, num_prompt_tokens, req, num_prompt_top)
        self.reasoning = reasoning  # --reasoning-parser: <think> text goes to reasoning_content
        self.tools = tools  # with tool calls: how the output becomes calls

    def cursor(self, index: int) -> ChoiceCursor:
        return ChoiceCursor(index, reasoning=self.reasoning.parser() if self.reasoning else None,
                            tools=ToolCallStream(self.tools, whole_calls=True) if self.tools else None)

    def response(self) -> ChatCompletionResponse:
        states = self.states
        choices = [self.whole_choice(self.cursor(i), state) for i, state in enumerate(states)]
        return ChatCompletionResponse(**self.base, object="chat.completion", choices=choices, usage=self.usage(),
                                      prompt_token_ids=states[0].prompt_ids if self.return_ids else None,
                                      prompt_logprobs=self.prompt_logprobs(states[0]))

    def whole_choice(self, cursor: ChoiceCursor, state: RequestState) -> ChatChoice:
        piece = cursor.advance(state)
        if self.reasoning is None:
            message = AssistantMessage(role="assistant", content=piece.text)
        else:  # an empty part is null (as vLLM answers)
            message = AssistantMessage(role="assistant", content=piece.text or None,
                                       reasoning_content=piece.reasoning or None)
        if self.tools is not None:  # tool calls are read in the answer, after any reasoning
            message.content, message.tool_calls = tool_answer(message.content or "", self.tools)
        reason = "tool_calls" if message.tool_calls and piece.finish_reason == "stop" else piece.finish_reason
        return ChatChoice(index=cursor.index, message=message,
                          logprobs=chat_logprobs(state, piece.logprobs_start) if state.wants_logprobs else None,
                          finish_reason=reason, token_ids=self.ids(piece.token_ids))

    def opening(self) -> Iterator[ChatCompletionChunk]:
        """Each choice's role, before any text; the first carries the prompt's ids (return_token_ids)."""
        for i in range(len(self.states)):
            first = self.chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""), logprobs=None,
                                                finish_reason=None)])
            if self.return_ids and i == 0:
                first.prompt_token_ids = self.states[0].prompt_ids
            yield first

    def stream_choices(self, cursor: ChoiceCursor, state: RequestState) -> list[ChatChunkChoice]:
        """What the state adds to the choice, one chunk's choice each."""
        piece = cursor.advance(state)
        if cursor.tools is not None:
            return self.tool_choices(cursor, state, piece)
        if self.is_empty(piece):
            return []
        delta = ChatDelta(content=piece.text or None, reasoning_content=piece.reasoning or None)
        logprobs = chat_logprobs(state, piece.logprobs_start) if state.wants_logprobs else None
        return [ChatChunkChoice(index=cursor.index, delta=delta, logprobs=logprobs, finish_reason=piece.finish_reason,
                                token_ids=self.ids(piece.token_ids))]

    def tool_choices(self, cursor: ChoiceCursor, state: RequestState, piece: Piece) -> list[ChatChunkChoice]:
        """With tool calls: the reasoning, then the answer as content and tool call deltas, one chunk each; the last
        carries the logprobs, ids and finish."""
        cursor.answer += piece.text
        pieces = cursor.tools.update(cursor.answer, state.finished)
        reason = "tool_calls" if piece.finish_reason == "stop" and cursor.tools.has_calls else piece.finish_reason
        out = []
        if piece.reasoning:
            out.append(ChatChunkChoice(index=cursor.index, delta=ChatDelta(reasoning_content=piece.reasoning),
                                       logprobs=None, finish_reason=None))
        token_ids = self.ids(piece.token_ids)
        if not pieces and reason is None and not piece.has_logprobs and not token_ids:
            return out
        pieces = pieces or [("", [])]
        logprobs = chat_logprobs(state, piece.logprobs_start) if piece.has_logprobs else None
        for k, (content, calls) in enumerate(pieces):
            last = k == len(pieces) - 1
            out.append(ChatChunkChoice(index=cursor.index, delta=ChatDelta(content=content or None,
                                                                           tool_calls=calls or None),
                                       logprobs=logprobs if last else None, finish_reason=reason if last else None,
                                       token_ids=token_ids if last else None))
        return out

    def chunk(self, choices: list, usage_: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.base, object="chat.completion.chunk", choices=choices,
                                   usage=self.chunk_usage(usage_))
