"""PyTorch's own cuDNN attention on meshtrain's layout, for its cuDNN logs.

Run with CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE=<file> (cudnn-frontend's graph, as
JSON) and CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=<file> (every backend call) to see the
descriptors PyTorch's cuDNN SDPA builds for a causal forward and backward over a (B,T,3C) qkv
split into heads, which is what ffi/cuda/sdpa-graph.ts builds by hand. Prints one JSON line:
the shapes, and whether PyTorch used cuDNN.
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, T, H, D = (int(x) for x in (sys.argv[1:5] if len(sys.argv) >= 5 else (1, 128, 2, 64)))
C = H * D
qkv = torch.randn(B, T, 3 * C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
q, k, v = qkv.split(C, dim=2)
q, k, v = (x.view(B, T, H, D).transpose(1, 2) for x in (q, k, v))  # (B,H,T,D), strides (T*3C, D, 3C, 1)
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y.transpose(1, 2).contiguous().view(B, T, C).float().square().sum().backward()
torch.cuda.synchronize()
print(json.dumps({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                  "q_strides": list(q.stride()), "grad_norm": float(qkv.grad.float().norm())}))
