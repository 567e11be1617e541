"""Engine: the same processes as the server, driven in-process without HTTP.

The Runtime and its GenerateService live on a private event loop in a background thread, so the sync methods block
on it and the async twins await it from any other loop, including one started after the Engine was built.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from loraplex.frontend.adapters.files import encode_tensors
from loraplex.frontend.generate import GenerateService
from loraplex.frontend.params import NativeGenerateRequest, convert
from loraplex.frontend.runtime import Runtime
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.errors import ServerError
from loraplex.protocol.structs import (
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqOutput,
    LoRAAdapterResult,
    LoRAAdapterSpec,
    UnloadLoRAAdapterReqOutput,
)

_END = object()
T = TypeVar("T")


# /generate's top-level logprob fields, taken as keyword arguments by generate and async_generate
LOGPROB_OPTIONS = {"return_logprob", "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs"}
# /generate's other fields the keyword arguments may set: a vision model's images (SGLang's image_data)
BODY_OPTIONS = LOGPROB_OPTIONS | {"image_data"}


class Engine:
    def __init__(self, **kwargs: Any):
        self.config = ServerConfig.from_kwargs(**kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="loraplex-engine", daemon=True)
        self._thread.start()
        self.runtime = Runtime(self.config)
        self.service = GenerateService(self.runtime)
        self._closed = False
        try:
            self._run(self.runtime.start())
        except BaseException:
            self.shutdown()
            raise

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _await(self, coro: Any) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    # ---- generation ----------------------------------------------------------------------------------

    @staticmethod
    def _body(prompt: str | list[str] | None, sampling_params: dict | None, lora_path: Any,
              input_ids: Any, rid: Any, stream: bool, logprob_options: dict,
              lora_scale: Any = None) -> NativeGenerateRequest:  # fmt: skip
        unknown = set(logprob_options) - BODY_OPTIONS
        if unknown:
            raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
        raw = {"text": prompt, "input_ids": input_ids, "sampling_params": sampling_params, "lora_path": lora_path,
               "lora_scale": lora_scale, "rid": rid, "stream": stream, **logprob_options}
        return convert({k: v for k, v in raw.items() if v is not None}, NativeGenerateRequest, "generate request")

    async def _generate(self, body: NativeGenerateRequest) -> dict | list[dict]:
        states, batched = await self.service.start(body)
        try:
            return await self.service.collect(states, batched)
        finally:
            await self.service.finish(states)

    async def _chunks(self, body: NativeGenerateRequest) -> AsyncIterator[dict]:
        states: list = []
        try:
            states, batched = await self.service.start(body)
            async for chunk in self.service.chunks(states, batched):
                yield chunk
        finally:
            await self.service.finish(states)

    @staticmethod
    async def _pump(items: AsyncIterator[Any], sink: Callable[[Any], None]) -> None:
        """Hands each item to the consumer's side, then a failure (re-raised there) or the end."""
        try:
            async for item in items:
                sink(item)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            sink(e)
        finally:
            sink(_END)

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | None = None,
                 lora_path: Any = None, *, input_ids: Any = None, rid: Any = None, lora_scale: Any = None,
                 stream: bool = False, **logprob_options: Any) -> dict | list[dict] | Iterator[dict]:
        """lora_path and lora_scale as /generate takes them (an adapter name or a lora_mix dict; its strength);
        logprob_options: return_logprob, top_logprobs_num, logprob_start_len, return_text_in_logprobs; and
        image_data, a vision model's images as /generate takes them."""
        body = self._body(prompt, sampling_params, lora_path, input_ids, rid, stream, logprob_options, lora_scale)
        if not stream:
            return self._run(self._generate(body))
        return self._sync_stream(body)

    def _sync_stream(self, body: NativeGenerateRequest) -> Iterator[dict]:
        items: queue.Queue = queue.Queue()
        future = asyncio.run_coroutine_threadsafe(self._pump(self._chunks(body), items.put), self._loop)
        try:
            while (item := items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: dict | None = None,
                             lora_path: Any = None, *, input_ids: Any = None, rid: Any = None,
                             lora_scale: Any = None, stream: bool = False,
                             **logprob_options: Any) -> dict | list[dict] | AsyncIterator[dict]:  # fmt: skip
        body = self._body(prompt, sampling_params, lora_path, input_ids, rid, stream, logprob_options, lora_scale)
        if not stream:
            return await self._await(self._generate(body))
        return self.async_iterate(lambda _: self._chunks(body))

    async def async_iterate(self, make: Callable[[GenerateService], AsyncIterator[T]]) -> AsyncIterator[T]:
        """The items of make(service), run on the Engine's loop, yielded on the caller's (the Ray replica serves
        the OpenAI API this way). Leaving early cancels it there, so what it submitted ends."""
        caller = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        async def run() -> None:
            await self._pump(make(self.service), lambda item: caller.call_soon_threadsafe(items.put_nowait, item))

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            while (item := await items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    # ---- adapters ----------------------------------------------------------------------------------------

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool | None = None,
                          load_inplace: bool = False, draft_lora_path: str | None = None) -> LoadLoRAAdapterReqOutput:
        return self._run(self._load(lora_name, lora_path, pinned, load_inplace, draft_lora_path))

    async def async_load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool | None = None,
                                      load_inplace: bool = False,
                                      draft_lora_path: str | None = None) -> LoadLoRAAdapterReqOutput:
        return await self._await(self._load(lora_name, lora_path, pinned, load_inplace, draft_lora_path))

    def unload_lora_adapter(self, lora_name: str) -> UnloadLoRAAdapterReqOutput:
        return self._run(self._unload(lora_name))

    async def async_unload_lora_adapter(self, lora_name: str) -> UnloadLoRAAdapterReqOutput:
        return await self._await(self._unload(lora_name))

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: dict[str, Any], config_dict: dict,
                                       pinned: bool | None = None,
                                       load_inplace: bool = False) -> LoadLoRAAdapterReqOutput:
        """An adapter from torch tensors named as in adapter_model.safetensors and adapter_config.json's content
        (SGLang's order of arguments). It has no path: never evicted, not in --lora-state-file."""
        return self._run(self._load_tensors(lora_name, tensors, config_dict, pinned, load_inplace))

    async def async_load_lora_adapter_from_tensors(self, lora_name: str, tensors: dict[str, Any], config_dict: dict,
                                                   pinned: bool | None = None,
                                                   load_inplace: bool = False) -> LoadLoRAAdapterReqOutput:
        return await self._await(self._load_tensors(lora_name, tensors, config_dict, pinned, load_inplace))

    async def _load_tensors(self, lora_name: str, tensors: dict[str, Any], config_dict: dict, pinned: bool | None,
                            load_inplace: bool) -> LoadLoRAAdapterReqOutput:
        specs, buffers = encode_tensors(tensors)
        request = LoadLoRAAdapterFromTensorsReqInput(lora_name=lora_name, config_dict=config_dict, tensors=specs,
                                                     pinned=pinned, load_inplace=load_inplace)
        try:
            return await self.service.load_adapter_from_tensors(request, buffers)
        except ServerError as e:
            return _refused(LoadLoRAAdapterReqOutput, lora_name, e)

    async def _load(self, lora_name: str, lora_path: str, pinned: bool | None, load_inplace: bool,
                    draft_lora_path: str | None = None) -> LoadLoRAAdapterReqOutput:
        spec = LoRAAdapterSpec(lora_name=lora_name, lora_path=lora_path, pinned=pinned,
                               draft_lora_path=draft_lora_path)
        try:
            return await self.service.load_adapters([spec], load_inplace)
        except ServerError as e:  # refused as a whole (updates disabled, server unavailable): a value here too
            return _refused(LoadLoRAAdapterReqOutput, lora_name, e)

    async def _unload(self, lora_name: str) -> UnloadLoRAAdapterReqOutput:
        try:
            return await self.service.unload_adapters([lora_name])
        except ServerError as e:
            return _refused(UnloadLoRAAdapterReqOutput, lora_name, e)

    def list_lora_adapters(self) -> list[dict]:
        return self.runtime.registry.table()

    def abort_request(self, rid: str) -> bool:
        return self._run(self.service.abort(rid)).success

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.runtime.shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.shutdown()
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass


__all__ = ["Engine"]


def _refused(output_type: type, lora_name: str, error: ServerError) -> Any:
    result = LoRAAdapterResult(lora_name=lora_name, success=False, error_message=str(error), error_kind=error.kind)
    return output_type(success=False, error_message=str(error), results=[result])
