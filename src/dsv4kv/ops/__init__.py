"""The operations of one attention step, one folder per operation (docs/kernels.md).

Each folder holds the PyTorch reference (`reference.py`, the definition) beside its Triton kernel (`kernel.py`),
which reads and writes the cache's real page formats and equals the reference: bit for bit where it moves or
encodes data, within the tolerance tables of its tests where it sums (attention, indexer and top-k keep the device
functions their kernels share in `keys.py`: how keys are found, decoded and compared). The kernel's tiles, warps
and thresholds are data: one frozen config per GPU architecture in `tuning.py`, which a wrapper takes as `tuning=`
(default: the device's, `shared.tuning.pick`).

    rope/        interleaved RoPE: reference tables and rotation; the step's q RoPE rows
    projection/  the input projections' norms (`rms_norm_rows`), the compressors' row split, one-row GEMVs
    window/      the window ring: kv insert into the step page, the ring append
    compress/    compress-and-insert (pool, norm, RoPE, quantize, scatter) and the compressor state append
    indexer/     the lightning indexer: its query (RoPE, Hadamard, MXFP4 / FP8) and scores over paged keys
    topk/        exact top-k of score rows
    attention/   sparse attention with sink over the pages (the reference gathers the keys first)
    shared/      what the kernels share: launch options, encoders, argument checks, the tuning lookup, the reference's
                 step rows
"""
