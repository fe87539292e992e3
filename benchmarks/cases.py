"""The attention benchmark cases, shared by ``bench_sink_attention.py`` and ``ab_attention.py``.

No imports: ``ab_attention.py`` loads two builds of the package side by side and must not import
either through this module.
"""

# name: (total tokens, doc length, Hq, Hkv, D, window; 0 = causal)
ATTENTION_CASES = {
    "flint-2k-w513": (65536, 2048, 32, 4, 128, 513),
    "flint-8k-w513": (65536, 8192, 32, 4, 128, 513),
    "flint-32k-w513": (131072, 32768, 32, 4, 128, 513),
    "flint-2k-causal": (65536, 2048, 32, 4, 128, 0),
    "flint-8k-causal": (65536, 8192, 32, 4, 128, 0),
    "flint-32k-causal": (131072, 32768, 32, 4, 128, 0),
    "gptoss-8k-w128": (65536, 8192, 64, 8, 64, 128),
    "hq32kv8-8k-w128": (65536, 8192, 32, 8, 128, 128),
}
