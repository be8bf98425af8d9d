"""Draft trees: DDTree/chain construction and the padded buffers verification consumes."""

from ddtree_serve.tree.buffers import VerifyBatch, build_verify_batch
from ddtree_serve.tree.ddtree import build_chain, build_ddtree
from ddtree_serve.tree.ddtree_batch import build_ddtrees, lockstep_pays
from ddtree_serve.tree.device_build import DeviceTreeBatch, build_ddtree_batch, num_device_tree_nodes
from ddtree_serve.tree.draft_tree import DraftTree
from ddtree_serve.tree.topk import draft_topk
from ddtree_serve.tree.tree_batch import TreeBatch

__all__ = [
    "DeviceTreeBatch",
    "DraftTree",
    "TreeBatch",
    "VerifyBatch",
    "build_chain",
    "build_ddtree",
    "build_ddtree_batch",
    "build_ddtrees",
    "build_verify_batch",
    "draft_topk",
    "lockstep_pays",
    "num_device_tree_nodes",
]
