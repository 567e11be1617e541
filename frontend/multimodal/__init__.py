"""Images in requests, for a vision-language model: read, checked and processed by the checkpoint's own image
processor off the event loop, then put in the prompt as runs of placeholder tokens with their ImageInputs and M-RoPE
positions. The workers' vision encoder turns each ImageInput into the embeddings of its run.

images.py   ImagePipeline: a prompt's images from their sources to its ImageInputs (limit, thread pool, expansion)
sources.py  an image's bytes: data: URLs, file:// under --allowed-local-media-path, http(s):// with limits, base64
decode.py   bytes to an RGB PIL image, or a 400 naming the part (format, size, truncation, decompression bombs)
vision.py   VisionSpec from config.json (placeholder token, merge size, M-RoPE); one image through the processor
llama4.py   Llama 4's tiling (Llama4ImageProcessor without torchvision) and each image's tokens (Llama4Processor)
families.py  config.json -> the family's image layout (Gemma 3's, Llama 4's tiles, or vision.py's runs)
gemma3.py   Gemma 3's image runs: <start_of_image> expanded as Gemma3Processor lays it out
prompt.py   a prompt's placeholders expanded to each image's run; its M-RoPE positions
"""
