"""A PEFT model under the Trainer: the adapter files ``PeftModel.save_pretrained`` writes, staged.

``Trainer._save`` calls ``model.save_pretrained(output_dir, is_main_process=...)`` on a
``PeftModel`` (peft 0.10-0.21): for each adapter (``"default"`` at the top of the folder, any
other in a sub-folder of its name) ``adapter_model.safetensors`` holds exactly
``get_peft_model_state_dict(model, adapter_name=name)`` (tensors sharing storage cloned apart,
``metadata={"format": "pt"}``) and ``adapter_config.json`` the adapter's config with
``inference_mode=True`` (plus ``auto_mapping`` where it has no task type); ``README.md`` is the
model card. No base weight is written: a resume rebuilds the base model as the run did.

At the step :meth:`AdapterSnapshot.state` takes those tensors (views: the
:class:`~spot_callbacks.staging.StagingArea` copies them) and a private copy of each config as
``save_pretrained`` prepares it; in the background :meth:`AdapterSnapshot.write` writes the files
from them, never touching the live configs (``save_pretrained`` flips ``inference_mode`` on the
live one while it writes: a writer thread must not). Whether the embedding layers go in
(``save_embedding_layers="auto"``, which may ask the Hub whether the base config's vocabulary
changed) is decided once per ``train()``, at the first snapshot, not at every step.
"""

from __future__ import annotations

import collections
import copy
import os
from pathlib import Path
from typing import Any

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's SAFETENSORS_WEIGHTS_NAME
DEFAULT_ADAPTER = "default"


def peft_model_of(trainer: Any) -> Any:
    """The ``PeftModel`` whose ``save_pretrained`` the Trainer calls, or ``None`` for another model.

    As ``Trainer._save`` picks it: ``trainer.model``, else the accelerator's unwrapped model.
    """
    try:
        from peft import PeftModel
    except ImportError:
        return None
    for model in (trainer.model, trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)):
        if isinstance(model, PeftModel):
            return model
    return None


class AdapterSnapshot:
    """What ``save_pretrained`` writes of one ``PeftModel``, taken at the step and written later.

    Args:
        model: the ``PeftModel`` (see :func:`peft_model_of`).

    Example:
        >>> import torch, transformers, peft, tempfile
        >>> base = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
        >>> model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"]))
        >>> snapshot = AdapterSnapshot(model)
        >>> staged = snapshot.state()  # at the step (a StagingArea copies its tensors)
        >>> sorted(staged["default"]["tensors"])[0]
        'base_model.model.transformer.h.0.attn.c_attn.lora_A.weight'
        >>> folder = Path(tempfile.mkdtemp())
        >>> snapshot.write(staged, folder)  # in the background
        >>> sorted(path.name for path in folder.iterdir())
        ['README.md', 'adapter_config.json', 'adapter_model.safetensors']
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._with_embeddings: dict[str, bool] | None = None

    def state(self) -> dict[str, dict[str, Any]]:
        """Per adapter: its tensors (views of the parameters), its config as written, its ``auto_mapping``."""
        from peft import get_peft_model_state_dict

        if self._with_embeddings is None:
            self._with_embeddings = {name: self._saves_embeddings(name) for name in self.model.peft_config}
        state = {}
        for name, live_config in self.model.peft_config.items():
            config = copy.deepcopy(live_config)
            if config.base_model_name_or_path is None:  # as save_pretrained fills it in
                owner = self.model.base_model if config.is_prompt_learning else self.model.base_model.model
                config.base_model_name_or_path = owner.__dict__.get("name_or_path", None) or None
            config.inference_mode = True
            auto_mapping = None
            if config.task_type is None:
                base_class = self.model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
                auto_mapping = {
                    "base_model_class": base_class.__name__,
                    "parent_library": base_class.__module__,
                }
            tensors = get_peft_model_state_dict(
                self.model, adapter_name=name, save_embedding_layers=self._with_embeddings[name]
            )
            state[name] = {"tensors": tensors, "config": config, "auto_mapping": auto_mapping}
        return state

    def active_state(self) -> dict[str, Any]:
        """The active adapter's state dict as accelerate's FSDP saver takes it (``adapter_only``):
        DTensor values under FSDP2, for :func:`spot_callbacks.hf.fsdp.local_shards`."""
        from peft import get_peft_model_state_dict

        name = self.model.active_adapter
        if self._with_embeddings is None:
            self._with_embeddings = {name: self._saves_embeddings(name) for name in self.model.peft_config}
        return get_peft_model_state_dict(
            self.model, adapter_name=name, save_embedding_layers=self._with_embeddings[name]
        )

    def _saves_embeddings(self, name: str) -> bool:
        """What ``save_embedding_layers="auto"`` decides for adapter ``name`` (asked once per ``train()``)."""
        from peft import get_peft_model_state_dict

        auto = get_peft_model_state_dict(self.model, adapter_name=name, save_embedding_layers="auto")
        without = get_peft_model_state_dict(self.model, adapter_name=name, save_embedding_layers=False)
        return auto.keys() != without.keys()

    def write(self, staged: dict[str, dict[str, Any]], folder: Path) -> None:
        """Write the staged adapters into ``folder`` as ``save_pretrained(folder)`` would."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        self.model.create_or_update_model_card(os.fspath(folder))  # reads configs only
        for name, adapter in staged.items():
            target = folder if name == DEFAULT_ADAPTER else folder / name
            target.mkdir(parents=True, exist_ok=True)
            save_file(
                _unaliased(adapter["tensors"]), os.fspath(target / ADAPTER_WEIGHTS), metadata={"format": "pt"}
            )
            adapter["config"].save_pretrained(os.fspath(target), auto_mapping_dict=adapter["auto_mapping"])


def _unaliased(tensors: dict[str, Any]) -> dict[str, Any]:
    """safetensors refuses tensors that share storage: the later names get clones, as peft does."""
    import torch

    seen: dict[Any, str] = {}
    result = collections.OrderedDict()
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor):
            key = (tensor.untyped_storage().data_ptr(), tensor.device)
            if key in seen and tensor.numel():
                tensor = tensor.clone()
            else:
                seen[key] = name
            tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
        result[name] = tensor
    return result
