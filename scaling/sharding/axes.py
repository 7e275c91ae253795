"""Logical axis names: the only sharding vocabulary model code uses.

Parameters and activations get separate names where they shard differently (the
Levanter/Haliax idea: params map `embed` to the fsdp axis; compute does not).
"""

# Parameter dimensions.
LAYERS = "layers"  # stacked layer axis of scanned blocks
VOCAB = "vocab"
EMBED = "embed"  # model width D
HEADS = "heads"  # query heads N
KV_HEADS = "kv_heads"  # key/value heads K
HEAD_DIM = "head_dim"  # H
MLP = "mlp"  # SwiGLU width F
NORM = "norm"  # RMSNorm scale vectors

# Activation dimensions.
BATCH = "batch"
SEQ = "seq"
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_KV_HEADS = "act_kv_heads"
ACT_MLP = "act_mlp"
ACT_VOCAB = "act_vocab"

PARAM_AXES = (LAYERS, VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, NORM)
ACTIVATION_AXES = (BATCH, SEQ, ACT_EMBED, ACT_HEADS, ACT_KV_HEADS, HEAD_DIM, ACT_MLP, ACT_VOCAB)

# Mesh axes, in mesh order.
MESH_AXES = ("data", "fsdp", "tensor")
