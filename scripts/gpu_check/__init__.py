"""The one GPU check (GPU_CHECK.md is its specification): `python -m scripts.gpu_check --plan | --dry-run | --out DIR`.

    runner.py   the command line: groups in spawned children under caps, merged gpu_check.json
    plan.py     the groups, their caps, the device commands (plain Python: the parent never imports torch)
    report.py   the summary and the reviewer block
    lib.py      what every group shares: the recorder, the child entry point, timing, model files
    model.py    G0 env, G2 attention, G3 numerics          kernels.py  G1 kernels, G6 kernel timings
    latent.py   G2's latent attention (DeepSeek-V3's paged latent kernels)
    serving.py  G4 decode, G5 / G5b server                 server.py   a server subprocess for G5
    tp.py       G7 tensor parallel, G8 compute-sanitizer   quant.py    G9 quantized linears
    gated_delta.py  G1's Gated DeltaNet kernels against the torch mixer, and both timed
    moe.py      G9's MoE experts: the grouped kernel (plain, MXFP4), the device-routed step captured as a CUDA graph
    gpu_wheels.txt, fetch_gpu_wheels.sh   the wheels the GPU image lacks
"""
