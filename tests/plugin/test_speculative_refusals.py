"""Which speculative decoding --attention-backend CUSTOM serves: n-gram drafts and EAGLE heads,
sync or async scheduled (tests/serving/test_eagle.py runs both); other drafters' methods are
refused at start-up, naming why."""
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_chunkattn.plugin import support
from vllm_runs import tiny_model

pytestmark = pytest.mark.vllm


def fake_config(method, async_scheduling=False):
    spec = None if method is None else SimpleNamespace(method=method)
    return SimpleNamespace(speculative_config=spec,
                           scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))


def test_only_ngram_and_eagle_speculation_is_served():
    assert support.speculative_refusals(fake_config(None)) == []
    assert support.speculative_refusals(fake_config("ngram")) == []
    assert support.speculative_refusals(fake_config("eagle")) == []
    for method in ("eagle3", "mtp", "draft_model", "ngram_gpu", "suffix", "medusa"):
        assert support.speculative_refusals(fake_config(method)) == [
            f"speculative decoding with method {method!r} (served: 'ngram', 'eagle')"]
    for method in ("ngram", "eagle"):
        assert support.speculative_refusals(fake_config(method, async_scheduling=True)) == []


def test_ngram_with_the_flag_gets_the_tree_scheduler():
    from vllm.engine.arg_utils import EngineArgs

    from vllm_chunkattn.plugin import SCHEDULER_PATH, register
    register()
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    config = EngineArgs(model=str(tiny_model()), load_format="dummy", dtype="float32",
                        max_model_len=512, speculative_config=ngram,
                        attention_backend="CUSTOM").create_engine_config()
    assert config.scheduler_config.scheduler_cls == SCHEDULER_PATH
    assert config.scheduler_config.async_scheduling is False
    draft = {"method": "draft_model", "model": str(tiny_model()), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=re.escape("speculative decoding with method "
                                                   "'draft_model'")):
        EngineArgs(model=str(tiny_model()), load_format="dummy", dtype="float32",
                   max_model_len=512, speculative_config=draft,
                   attention_backend="CUSTOM").create_engine_config()
