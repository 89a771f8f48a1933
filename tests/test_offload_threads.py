"""Two threads' forwards on one offloaded layer (a server's requests on one model, session 54): the second runs
while the first holds experts in the cache's slots (paused in its first round, as a thread switch would pause it),
and each gets the plain layer's output for its own tokens (a hash layer's too). Before, the second's forward released
or evicted the first's experts, or found every slot held ("the expert cache has no slot to fetch into"). CPU: the
cache's "GPU" is the CPU too; the reference is the plain ``MoE`` the offloaded layer was built from (and the hash
layer's)."""

from __future__ import annotations

import threading

import torch

from moekit import MoE, MoEConfig
from moekit.layer_hash import HashMoE
from moekit.offload import OffloadedMoE

from _helpers import TOLERANCE, rel_l2

E, K, N = 8, 32, 16
TOL = TOLERANCE[torch.float32]


def _x(m: int, seed: int) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed))  # [M, K]


def _paused_while(off: OffloadedMoE, second) -> None:
    """Make ``off``'s next forward run ``second`` in a thread of its own once its first round's experts are in their
    slots, waiting for it a little (it waits on the lock: the time passes), then go on."""
    cache = off.cache
    ready = cache.wait_ready

    def wait_ready_once(layer, experts):
        cache.wait_ready = ready  # once: the second forward's rounds run as usual
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(timeout=0.5)  # unlocked, the second forward ran whole meanwhile
        off.second_thread = thread
        return ready(layer, experts)

    cache.wait_ready = wait_ready_once


def test_a_second_threads_forward_waits_for_the_first():
    cfg = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2)
    torch.manual_seed(0)
    moe = MoE(cfg, backend="grouped_mm", router="torch")
    off = OffloadedMoE.from_moe(moe, cache_experts=3)  # fewer slots than one batch touches: rounds, evictions
    x_a, x_b = _x(6, 1), _x(5, 2)
    got = {}

    def second():
        with torch.no_grad():
            got["b"] = off(x_b)

    _paused_while(off, second)
    with torch.no_grad():
        got["a"] = off(x_a)
        off.second_thread.join()
        assert rel_l2(got["a"], moe(x_a)) < TOL and rel_l2(got["b"], moe(x_b)) < TOL


def test_a_hash_layers_second_forward_waits_too():
    cfg = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2, scoring="sqrtsoftplus",
                    hash_table_size=32)
    torch.manual_seed(0)
    moe = HashMoE(cfg, backend="grouped_mm").load_table_(torch.randint(0, E, (32, 2), generator=torch.Generator()
                                                                       .manual_seed(3)))  # [V, k]
    off = OffloadedMoE.from_moe(moe, cache_experts=3)
    x_a, x_b = _x(6, 1), _x(5, 2)
    ids_a, ids_b = torch.arange(6), torch.arange(10, 15)  # [M] rows of the table
    got = {}

    def second():
        with torch.no_grad():
            got["b"] = off(x_b, token_ids=ids_b)

    _paused_while(off, second)
    with torch.no_grad():
        got["a"] = off(x_a, token_ids=ids_a)
        off.second_thread.join()
        assert rel_l2(got["a"], moe(x_a, ids_a)) < TOL and rel_l2(got["b"], moe(x_b, ids_b)) < TOL
