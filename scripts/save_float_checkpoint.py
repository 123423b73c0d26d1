"""Save a model as transformers loads it (a GGUF dequantised to float32) as a Hugging Face directory.

    .venv/bin/python scripts/save_float_checkpoint.py smollm2-135m-instruct /tmp/smollm2-f32

The float32 SmolLM2 the self-draft and --quantization figures of docs/experiments.md start from.
"""
import argparse

from safetensors.torch import save_file

from minispec.models.loader import load_hf_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", help="model spec: alias, .gguf file, HF directory")
    p.add_argument("out", help="output directory")
    args = p.parse_args()
    model, tokenizer = load_hf_model(args.spec)
    config = model.config
    if hasattr(config, "quantization_config"):  # transformers marks a GGUF-loaded model; the weights are float
        del config.quantization_config
    tied = getattr(config, "tie_word_embeddings", False)
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    config.save_pretrained(args.out)
    model.generation_config.save_pretrained(args.out)
    if tokenizer is not None:
        tokenizer.save_pretrained(args.out)
    save_file(weights, f"{args.out}/model.safetensors", metadata={"format": "pt"})
    print(f"wrote {args.out}: {len(weights)} tensors")


if __name__ == "__main__":
    main()
