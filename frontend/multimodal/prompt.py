"""A prompt's images put in its tokens: the chat template (or the client's text) leaves one image placeholder token
per image; each becomes the image's run of num_tokens placeholders (between begin and end tokens where the model's
processor puts them: Gemma 4), as the HF processor expands them, and the ImageInputs say where each run starts.
With M-RoPE the positions of the expanded prompt come too."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.frontend.errors import InputError
from loraplex.frontend.multimodal.vision import ProcessedImage, VisionSpec
from loraplex.protocol.mrope import mrope_positions
from loraplex.protocol.structs import ImageInput


@dataclass(frozen=True)
class PromptImages:
    """What TokenizedGenerateReq carries for one prompt's images."""

    input_ids: list[int]
    images: list[ImageInput]
    mrope_positions: list[list[int]] = field(default_factory=list)
    mrope_delta: int = 0


def expand_prompt(input_ids: list[int], images: list[ProcessedImage], spec: VisionSpec, what: str) -> PromptImages:
    """input_ids with each image's one placeholder expanded; `what` names the prompt in an error."""
    if spec.expand is not None:  # a family's own layout (Gemma 3)
        return spec.expand(input_ids, images, spec, what)
    token = spec.image_token_id
    at = [i for i, t in enumerate(input_ids) if t == token]
    if len(at) != len(images):
        raise InputError(f"{what}: {len(at)} image placeholder token(s) (id {token}) for {len(images)} image(s): "
                         "give one per image, where it goes")  # fmt: skip
    expanded: list[int] = []
    inputs: list[ImageInput] = []
    start = 0
    for pos, image in zip(at, images, strict=True):
        expanded += input_ids[start:pos]
        if spec.begin_token_id is not None:
            expanded.append(spec.begin_token_id)
        inputs.append(ImageInput(offset=len(expanded), num_tokens=image.num_tokens, content_hash=image.content_hash,
                                 pixel_values=image.pixel_values, shape=image.shape, grid_thw=image.grid_thw))
        expanded += [token] * image.num_tokens
        if spec.end_token_id is not None:
            expanded.append(spec.end_token_id)
        start = pos + 1
    expanded += input_ids[start:]
    if not spec.mrope:
        return PromptImages(expanded, inputs)
    rows, delta = mrope_positions(expanded, token, [image.grid_thw for image in images], spec.merge_size)
    return PromptImages(expanded, inputs, rows, delta)
