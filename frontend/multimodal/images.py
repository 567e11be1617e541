"""ImagePipeline: a request's images from their sources to the prompt's ImageInputs — counted against
--limit-mm-per-prompt before anything is fetched, read (sources.py), decoded and checked (decode.py) and processed by
the model's image processor (vision.py) on a pool of threads so the event loop keeps serving, then put in the prompt
(prompt.py). A model that takes no images refuses any, whatever their source."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loraplex.frontend.errors import InputError
from loraplex.frontend.multimodal.decode import decode_image
from loraplex.frontend.multimodal.families import read_vision_spec
from loraplex.frontend.multimodal.llama4 import Llama4ImageProcessor, Llama4Spec, TiledImage, expand_llama4
from loraplex.frontend.multimodal.prompt import PromptImages, expand_prompt
from loraplex.frontend.multimodal.sources import MediaAccess, image_bytes
from loraplex.frontend.multimodal.vision import (
    ProcessedImage,
    VisionSpec,
    load_image_processor,
    min_side,
    no_images_error,
    process_image,
)
from loraplex.protocol.config import ServerConfig

logger = logging.getLogger("loraplex.images")

POOL_THREADS = 4

ImageSource = tuple[str, str]  # (what: the part of the request it is, for errors; the source string)


class ImagePipeline:
    def __init__(self, spec: VisionSpec | Llama4Spec | None, processor: Any, access: MediaAccess, limit: int):
        self.spec = spec  # None: the model takes no images
        self.processor = processor
        self.access = access
        self.limit = limit
        self._pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="loraplex-images") if spec else None

    @classmethod
    def load(cls, model_dir: str, config: ServerConfig) -> ImagePipeline:
        """Blocking (reads the processor's files): Runtime.start runs it on an executor."""
        spec = read_vision_spec(model_dir)
        if isinstance(spec, Llama4Spec):
            processor = Llama4ImageProcessor.load(model_dir, spec)
            logger.info("images: Llama 4 tiles of %d pixels (at most %d an image), %d placeholders a tile, at most %d "
                        "a prompt", processor.size, processor.max_patches, spec.tokens_per_tile, config.image_limit)
        elif spec is not None:
            processor = load_image_processor(model_dir)
            logger.info("images: placeholder token %d, merge %d, M-RoPE %s, %s, at most %d a prompt",
                        spec.image_token_id, spec.merge_size, spec.mrope, type(processor).__name__, config.image_limit)
        else:
            processor = None
        return cls(spec, processor, MediaAccess(local_root=config.allowed_local_media_path), config.image_limit)

    @property
    def modalities(self) -> list[str]:
        return ["text", "image"] if self.spec is not None else ["text"]

    def check_count(self, count: int, what: str) -> None:
        """Before any image is read: a model without vision, or more images than --limit-mm-per-prompt, is a 400."""
        if count and self.spec is None:
            raise no_images_error()
        if count > self.limit:
            raise InputError(f"{what}: {count} images, more than the {self.limit} a prompt may have "
                             "(--limit-mm-per-prompt)")  # fmt: skip

    async def process(self, sources: list[ImageSource], *, bare: bool = False) -> list[ProcessedImage | TiledImage]:
        """Every image read, decoded and processed, concurrently; the first refusal is raised."""
        return list(await asyncio.gather(*(self._one(what, source, bare) for what, source in sources)))

    async def _one(self, what: str, source: Any, bare: bool) -> ProcessedImage | TiledImage:
        data = await image_bytes(source, what, self.access, bare=bare)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._decode_and_process, data, what)

    def _decode_and_process(self, data: bytes, what: str) -> ProcessedImage | TiledImage:
        image = decode_image(data, what, min_side(self.processor))
        if isinstance(self.spec, Llama4Spec):
            return self.processor(image)
        return process_image(self.processor, self.spec, image, what)

    async def prompt(self, input_ids: list[int], sources: list[ImageSource], what: str, *,
                     bare: bool = False) -> PromptImages:
        """One prompt with its images: input_ids expanded, the ImageInputs and M-RoPE positions."""
        self.check_count(len(sources), what)
        images = await self.process(sources, bare=bare)
        if isinstance(self.spec, Llama4Spec):
            return PromptImages(*expand_llama4(input_ids, images, self.spec, what))
        return expand_prompt(input_ids, images, self.spec, what)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
