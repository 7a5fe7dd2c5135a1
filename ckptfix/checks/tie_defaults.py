"""The model types whose config class leaves `tie_word_embeddings` False when config.json
does not set it (every other type defaults to True, PretrainedConfig's default). Read off
transformers 5.24's config classes; tests/test_tie_defaults.py checks it against the
installed transformers."""

UNTIED_BY_DEFAULT = frozenset(
    {
    "EvollaModel", "afmoe", "apertus", "apertus1p5", "apertus1p5_text", "arcee", "aria",
    "aria_text", "axk1", "axk2", "bailing_hybrid", "bamba", "beam", "bitnet", "blt",
    "blt_global_transformer", "blt_local_decoder", "blt_local_encoder", "blt_patcher",
    "bridgetower", "chameleon", "codegen", "cohere_asr", "cohere_compass", "cosmos3_edge",
    "cosmos3_edge_text", "cosmos3_omni", "cwm", "dbrx", "deepseek_ocr2", "deepseek_ocr2_encoder",
    "deepseek_ocr2_text", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "diffllama",
    "doge", "dory", "dots1", "dots3_note", "dots3_note_text", "emu3", "emu3_text_model", "esmc",
    "eurobert", "evolla", "exaone", "exaone4", "exaone4_5", "exaone_moe", "falcon_h1", "fast_vlm",
    "flex_olmo", "flint", "fsmt", "fuyu", "git", "glm", "glm4", "glm46v", "glm4_moe",
    "glm4_moe_lite", "glm4v", "glm4v_moe", "glm4v_moe_text", "glm5_next", "glm5_next_text",
    "glm_image", "glm_moe_dsa", "glm_ocr", "glmga", "gpt_neox", "gpt_oss", "gptj", "granite",
    "granite4_vision", "granite4_vision_text", "granitemoe", "granitemoe_swa", "granitemoehybrid",
    "granitemoeshared", "helium", "higgs_audio_v2", "hrm_text", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "hy_v3", "hy_v4", "hy_v4_vl", "hy_v4_vl_text", "hyperclovax", "idefics",
    "idefics2", "idefics3", "imagegpt", "internlm3", "iquestcoder", "jais2", "jamba",
    "kimi_linear", "kolibri1", "kyutai_speech_to_text", "laguna", "llama", "llama4", "llama4_text",
    "llava", "llava_next", "llava_next_video", "llava_onevision", "longcat_flash", "mamba2",
    "mellum", "mimo_v2_flash", "minicpmv4_6", "minicpmv4_7", "minimax", "minimax_m2",
    "minimax_m3_vl", "minimax_m3_vl_text", "ministral", "ministral3", "mistral", "mistral4",
    "mistral_large4", "mistral_large4_text", "mixtral", "mllama_text_model", "modernvbert",
    "molmo2", "molmo2_text", "moonshine_streaming", "moshi", "moshi_depth", "muse_glimmer_text",
    "muse_spark_text", "musicgen_decoder", "musicgen_melody_decoder", "nanochat", "nemotron",
    "nemotron_h", "neucodec", "olmo", "olmo2", "olmo3", "olmo_hybrid", "olmoe",
    "openai_privacy_filter", "perception_lm", "persimmon", "phi", "phi3", "phi4_multimodal",
    "phimoe", "pix2struct", "pix2struct_text_model", "pp_formulanet_text", "qianfan_ocr", "qwen2",
    "qwen2_5_omni_talker", "qwen2_5_omni_thinker", "qwen2_5_vl", "qwen2_moe", "qwen2_vl", "qwen3",
    "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next",
    "qwen3_omni_moe_talker_code_predictor", "qwen3_omni_moe_talker_text", "qwen3_omni_moe_thinker",
    "qwen3_vl", "qwen3_vl_moe", "qwen4_exp", "qwen4_exp_text", "reformer", "rembert", "rwkv",
    "sarvam_mla", "sarvam_moe", "seed_oss", "smolvlm", "solar_open", "stablelm", "step3p5",
    "ultrabert", "ultravbert", "unlimited_ocr", "unlimited_ocr_text", "vibevoice", "video_llama_3",
    "video_llava", "vipllava", "xcodec2", "xlstm",
    }
)  # fmt: skip
