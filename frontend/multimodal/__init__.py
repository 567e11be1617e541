"""Images in requests, for a vision-language model: OpenAI chat's image_url parts and SGLang's image_data read
(sources.py), decoded and checked (decode.py), processed by the checkpoint's image processor (vision.py) off the event
loop (images.py), and put in the prompt as runs of placeholder tokens with their ImageInputs and M-RoPE positions
(prompt.py). The workers' vision encoder turns each ImageInput into the embeddings of its run."""
