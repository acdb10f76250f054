"""Parameter counts reproduce spec/kimi-family.md §7 exactly."""

from deltamoe.config import load_preset
from deltamoe.plan.params import count_params
from deltamoe.plan.reference_models import deepseek_v3, kimi_k2


def test_k3_components_match_spec_table():
    p = count_params(load_preset("kimi-k3"))
    assert p.kda_layer == 443_740_384
    assert p.mla_layer == 232_196_096
    assert p.dense_mlp == 726_663_168
    assert p.expert == 33_030_144
    assert p.num_experts * p.expert + p.router + p.latent_proj + p.shared_experts == 29_784_936_832
    assert p.top_k * p.expert + p.router + p.latent_proj + p.shared_experts == 718_410_112
    assert p.norms == 4_021_248
    assert p.embedding == p.lm_head == 1_174_405_120
    assert (p.n_kda, p.n_mla, p.n_dense, p.n_moe) == (69, 24, 1, 92)


def test_k3_totals_match_spec():
    p = count_params(load_preset("kimi-k3"))
    assert p.text_total == 2_779_484_476_000
    assert p.active == 104_189_612_640
    assert p.routed == 2_722_740_830_208
    assert p.text_total - p.routed == 56_743_645_792
    assert (p.vision_tower, p.projector) == (401_214_464, 46_144_512)
    assert p.vision == 447_358_976
    assert p.total == 2_779_931_834_976


def test_k31_pro_adds_the_indexers_only():
    k3, k31 = count_params(load_preset("kimi-k3")), count_params(load_preset("kimi-k3.1-pro"))
    assert k31.dsa_indexer == 7_438_592 and k31.n_dsa == 24
    assert k31.text_total - k3.text_total == 178_526_208
    assert k31.active - k3.active == 178_526_208  # indexers run for every token


def test_reference_models_match_their_published_sizes():
    ds = count_params(deepseek_v3())
    assert ds.text_total == 671_026_419_200  # "671 B" (MTP layer excluded, as DeepSeek counts)
    assert 36e9 < ds.active < 38e9  # "37 B activated"
    k2 = count_params(kimi_k2())
    assert 1.02e12 < k2.text_total < 1.04e12 and 31e9 < k2.active < 33e9
