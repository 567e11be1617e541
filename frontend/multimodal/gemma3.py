"""Gemma 3's images in a prompt, as Gemma3Processor lays them out: the prompt holds `<start_of_image>` (boi) where an
image goes, and each becomes "\\n\\n" + boi + mm_tokens_per_image x `<image_soft_token>` + `<end_of_image>` + "\\n\\n";
the soft tokens are the image's placeholder run (the vision tower's rows replace them). The processor inserts that
text before tokenizing; here the prompt is already tokens, so the blank lines are the tokenizer's tokens for "\\n\\n",
and where a neighbouring token is whitespace alone (a "\\n" or a space before the image), the two are tokenized
together, as the text would be. Every image is one fixed-size square (no pan and scan)."""

from __future__ import annotations

from typing import Any

from loraplex.frontend.errors import InputError
from loraplex.frontend.multimodal.prompt import PromptImages
from loraplex.frontend.multimodal.vision import ProcessedImage, VisionSpec
from loraplex.protocol.structs import ImageInput

BLANK = "\n\n"


def gemma3_spec(hf: dict[str, Any], model_dir: str | None) -> VisionSpec | None:
    """The spec of a gemma3 checkpoint with a vision tower, its tokenizer read from model_dir; None: no tower (or no
    tokenizer to lay its images out with)."""
    if not isinstance(hf.get("vision_config"), dict) or model_dir is None:
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"the model at {model_dir} takes images, but its tokenizer does not load: {e}") from e
    vocab = tokenizer.get_vocab()
    ids = {}
    for key, token, default in (("boi", "<start_of_image>", 255_999), ("eoi", "<end_of_image>", 256_000),
                                ("soft", "<image_soft_token>", 262_144)):  # fmt: skip
        ids[key] = hf.get(f"{key}_token_index", vocab.get(token, default))
    ids["soft"] = hf.get("image_token_index", ids["soft"])
    return VisionSpec(image_token_id=ids["soft"], merge_size=1, mrope=False, prompt_token_id=ids["boi"],
                      end_token_id=ids["eoi"], tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
                      processor_kwargs={"do_pan_and_scan": False}, tokenizer=tokenizer,
                      expand=expand_gemma3)  # fmt: skip



def expand_gemma3(input_ids: list[int], images: list[ProcessedImage], spec: VisionSpec, what: str) -> PromptImages:
    """input_ids with each `<start_of_image>` made the image's whole sequence; `what` names the prompt in errors."""
    boi, soft = spec.prompt_token_id, spec.image_token_id
    at = [i for i, t in enumerate(input_ids) if t == boi]
    if len(at) != len(images):
        raise InputError(f"{what}: {len(at)} image start token(s) <start_of_image> (id {boi}) for {len(images)} "
                         "image(s): give one per image, where it goes")  # fmt: skip
    if soft in input_ids:
        raise InputError(f"{what}: the prompt holds the image soft token (id {soft}) itself; give <start_of_image> "
                         "where an image goes")  # fmt: skip
    expanded: list[int] = []
    inputs: list[ImageInput] = []
    start = 0
    for pos, image in zip(at, images, strict=True):
        expanded = _join(spec.tokenizer, expanded + input_ids[start:pos], BLANK) + [boi]
        inputs.append(ImageInput(offset=len(expanded), num_tokens=image.num_tokens, content_hash=image.content_hash,
                                 pixel_values=image.pixel_values, shape=image.shape, grid_thw=image.grid_thw))
        expanded += [soft] * image.num_tokens + [spec.end_token_id]
        start = pos + 1
        # the blank line after the image, with the prompt's next token when that is whitespace too
        rest = input_ids[start : start + 1]
        if rest and _is_blank(spec.tokenizer, rest[0]):
            expanded += spec.tokenizer.encode(BLANK + spec.tokenizer.decode(rest), add_special_tokens=False)
            start += 1
        else:
            expanded += spec.tokenizer.encode(BLANK, add_special_tokens=False)
    expanded += input_ids[start:]
    return PromptImages(expanded, inputs)


def _join(tokenizer: Any, ids: list[int], text: str) -> list[int]:
    """ids followed by the tokens of text; a last token of whitespace alone is tokenized with it."""
    if ids and _is_blank(tokenizer, ids[-1]):
        return ids[:-1] + tokenizer.encode(tokenizer.decode(ids[-1:]) + text, add_special_tokens=False)
    return ids + tokenizer.encode(text, add_special_tokens=False)


def _is_blank(tokenizer: Any, token: int) -> bool:
    text = tokenizer.decode([token])
    return bool(text) and not text.strip()
