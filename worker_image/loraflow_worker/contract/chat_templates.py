"""The chat templates the image's TRL (1.16) has a training version of: the version with `{% generation %}` markers
that SFT trains with when a model's own template has none (TRL's `get_training_chat_template`, which recognises a
template by its exact text). Keyed by the sha256 of the model's template, so that the control plane, which has no
TRL, knows before renting which template the worker will train a model's chats with. A worker test recomputes the
table from the installed TRL: a TRL upgrade that changes it fails there.
"""

from __future__ import annotations

import hashlib

TRL_TRAINING_TEMPLATES: dict[str, str] = {
    "90c33aee14aa2a226127516d48ee9184c9b90745d4a04c484621ec2e82fb712c": "cohere_training",
    "2147c474f41b522b7296f74692b9f31e45f49a31465960576a9d321339c5915a": "cohere2_training",
    "56a1447ad31926fdc21fb07e56e5642bd9c850c4f52d8c8af7bbe5f079a84f5f": "deepseek_r1_distill_training",
    "563b1ce7d61d50a9b4c7439a912a1116f095b712df5b5e4d3e1116049874eb64": "deepseekv3_training",
    "9aeb7eac68ad87bba7567e9d4597ff203e5609f1b427d9e823437d0142cc61bf": "diffusion_gemma_training",
    "ecd6ae513fe103f0eb62e8ab5bfa8d0fe45c1074fa398b089c93a7e70c15cfd6": "gemma_training",
    "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4": "gemma3_training",
    "44f815868bf02fa458dd2f741a338046f4bf45f398eb6d067766726b9d96cce3": "glm4moe_training",
    "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146": "gptoss_training",
    "0d7e56ca41705b79932de707b22bc855c3cfcefae62f1ac5e458560654883d2e": "idefics3_training",
    "cef187400d62a59507aab3a642ea9a8d2a2ef263562bc3430560e116945273cf": "lfm2_training",
    "5504d163d879bfb6fd4135b7fa3d56768b2e69dd718338f7b146750289f46ab0": "lfm2_v2_training",
    "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122": "llama3_training",
    "2c17243a977fd0643fb549a509a8e2684f45517df0f9f608d5893b719f16569f": "llava_next_training",
    "cfc67e5f349f37690dfd31ed1f18bc4442a9dd32fe39a648f993cb4eb3cae678": "muse_glimmer_training",
    "58933db77d3099b4f78c55a38347a72e1ea05b97d6bd8f38775303dc0194e0a9": "nemotron_3_5_lightning_training",
    "ab7813c3abdd9cb655905a410728b26c7884eca45ddfab8d9f931553485a7862": "nemotron_3_nano_training",
    "575fb74f54ed264df9047d0ecce3c98938aae953fb4f50356675706264cbb68a": "nemotron_3_super_training",
    "82753bef5cedc4932c1ed509b5c9a12be680fd86d1adb65bc3f7398d11c8eebc": "nemotron_3_ultra_training",
    "dcaee66df77bfbb789ec541fe713218da30225a526f1db97138fc39ee6dc56aa": "phi3_training",
    "78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90": "phi3_5_training",
    "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f": "qwen2_5_training",
    "a0bc6f6fc7a29a80017a433e8f03a1cc1236e838a944a2d034295a60c4f2fddb": "qwen2_5_vl_training",
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": "qwen3_training",
    "273d8e0e683b885071fb17e08d71e5f2a5ddfb5309756181681de4f5a1822d80": "qwen3_5_nothink_training",
    "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715": "qwen3_5_think_training",
    "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259": "qwen3_6_training",
    "c3cf9e34abf4f9e36c2d72165aa9c132d3e2a725b6c2586aaa3a8af9d7a81041": "qwen3_8_training",
    "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326": "qwen3_instruct_2507_training",
    "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4": "qwen3_vl_training",
    "830005085ddd94cec605b6e21b885b28ffad6e3f82ee6a212c523533e8f04f01": "smolvlm_training",
}
"""sha256 of a model's chat template → the name of TRL's training template for it (a `.jinja` file of TRL's
`chat_templates` folder)."""


def trl_training_template(template: str) -> str | None:
    """The name of TRL's training template for a model whose chat template is `template`; None when TRL has none."""
    return TRL_TRAINING_TEMPLATES.get(hashlib.sha256(template.encode()).hexdigest())


def trl_template_names() -> list[str]:
    """The names `training.chat_template` accepts besides a `.jinja` file: TRL's training templates."""
    return sorted(set(TRL_TRAINING_TEMPLATES.values()))
