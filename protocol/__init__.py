"""Wire types and sockets shared by every process. Nothing else imports zmq.

structs.py          every struct that crosses a process boundary; one tagged union per socket direction
sockets.py          typed ZeroMQ sockets: one union of structs each way, msgpack, tensor frames
curve.py            the cluster key: ZeroMQ CURVE on every TCP socket between processes
rpc.py              the internal RPC wire format, for a client in any language
config.py           ServerConfig: every launch flag, validated once, and the CLI generated from it
foreign_flags.py    vLLM's and SGLang's flags with no loraplex setting: accepted where it already does so
errors.py           ServerError, and the one table from an error's kind to its HTTP status
proc.py             what every child process shares at start-up: its arguments, dying with its parent, logging
progress.py         progress of long start-up work: a tqdm bar on a terminal, log lines otherwise
faults.py           test-only fault injection into the workers, inert unless the environment asks for it
model_ref.py        what a model path names: a local directory, a Hub id, a cache snapshot
quantization.py     which quantization a checkpoint is served with
request_limits.py   whether a request can ever run: the one rule, at the edge and in the scheduler
grammar.py          what an OutputConstraint means: its kind -> xgrammar's compile call
adapter_config.py   adapter_config.json, parsed once by one rule set
adapter_files.py    a PEFT adapter directory's files, opened inside --lora-path-root
adapter_outcomes.py  the all-or-nothing merge of an adapter load answered by several members
lora_targets.py     the one table of the linears a LoRA adapter may target
lora_shards.py      which part of each PEFT LoRA weight a tensor-parallel rank keeps
mathutil.py         small integer helpers (ceiling division)
"""
