"""Speculative decoding with a quantized draft of the experts (Specter, arXiv 2511.14102), as explicit steps.

One iteration after the last committed token t (not yet in the KV cache), in `decoder.SpeculativeDecoder`:

1. **draft** (`draft`): k one-token forwards with the draft's experts from t propose d_1 .. d_k (greedy: their
   argmax; sampled: a draw from the draft's distribution); they chain on the device (CUDA graphs where
   available), the lookahead buffer counts their routing;
2. **lookahead** (`lookahead`): at chunk boundaries the counts reach the host and the experts the draft used are
   prefetched into the target's expert cache (while the draft goes on when it chains on the device);
3. **verify**: one target forward over [t, d_1 .. d_k] writes the target's keys/values over the draft's and
   judges the drafts on the device; each MoE layer waits on the device for its own prefetches, then takes its
   experts from cache slots or, not there, from host memory;
4. **accept** (`accept`): the drafted tokens the target keeps and its own token after them (one host read per
   iteration); the KV cache is cut back to the accepted tokens.

The depth k of each iteration is fixed (`--n-draft K`) or chosen from the measured acceptance and costs
(`depth`, `--n-draft auto`, the default).
"""

from specter_gguf.speculation.accept import accept_drafts, synthetic_acceptance
from specter_gguf.speculation.decoder import DEFAULT_N_DRAFT, SpeculativeDecoder
from specter_gguf.speculation.depth import MAX_DEPTH, DepthChooser

__all__ = ["DEFAULT_N_DRAFT", "MAX_DEPTH", "DepthChooser", "SpeculativeDecoder", "accept_drafts",
           "synthetic_acceptance"]
