"""Code the tests share: the fault-run driver (fault_helpers), tiny transformers checkpoints
(hf_fixtures), the proxy model and packed rows (proxy_fixtures), and the scripts tests launch under
torchrun (mp_cp, mp_logits). Imported as ``helpers.<module>``: tests/conftest.py puts tests/ on
sys.path. Data files the tests read are in tests/fixtures/."""
