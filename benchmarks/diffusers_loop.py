"""The baseline of bench_pipeline: fine-tuning an SDXL pipeline's U-Net the way diffusers' own
``examples/text_to_image/train_text_to_image_sdxl.py`` does it, from a pipeline folder and a shapes table.

As that script: an ``accelerate.Accelerator`` (no mixed precision on CPU), the U-Net loaded with
``from_pretrained`` and trained, the VAE and both text encoders run once over the whole dataset before training
(its ``compute_vae_encodings``, a training batch of images a call, and ``encode_prompt`` through ``datasets.map``,
1,000 captions a call; here into memory), each image resized
and centre-cropped to ``--resolution``, the micro-conditioning ``time_ids`` from its original size and crop, a
DDPM noise schedule from the folder's ``scheduler/`` (epsilon), AdamW, MSE. Prints one ``BENCH`` line: the wall
time of the first step and the steps/s after ``--warmup-steps``.

With ``--lora-rank R`` it trains a LoRA on the frozen U-Net instead, as ``examples/dreambooth/
train_dreambooth_lora_sdxl.py`` does (the baseline of bench_lora): ``unet.requires_grad_(False)``, peft's
``LoraConfig(r=R, lora_alpha=R, init_lora_weights="gaussian", target_modules=["to_k", "to_q", "to_v",
"to_out.0"])`` put in with ``unet.add_adapter``, AdamW over the parameters that require a gradient.

    python -m benchmarks.diffusers_loop --pipeline FOLDER --metadata shapes/metadata.parquet --steps 60
"""

import argparse
import json
import os
import time

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--metadata", required=True)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-rank", type=int, default=0, help="train a LoRA of this rank (0: the whole U-Net)")
    args = parser.parse_args()

    import pyarrow.parquet as pq
    from accelerate import Accelerator
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from PIL import Image
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(args.seed)
    accelerator = Accelerator(mixed_precision="no")
    folder = args.pipeline
    scheduler = DDPMScheduler.from_pretrained(folder, subfolder="scheduler")
    unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet")
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae").requires_grad_(False)
    encoders = [CLIPTextModel.from_pretrained(folder, subfolder="text_encoder").requires_grad_(False),
                CLIPTextModelWithProjection.from_pretrained(folder, subfolder="text_encoder_2").requires_grad_(False)]
    tokenizers = [AutoTokenizer.from_pretrained(folder, subfolder=name) for name in ("tokenizer", "tokenizer_2")]

    # Precompute, as the script's datasets.map over compute_vae_encodings and encode_prompt.
    table = pq.read_table(args.metadata).to_pydict()
    root = os.path.dirname(os.path.abspath(args.metadata))
    latents, hidden, pooled, time_ids = [], [], [], []
    size = args.resolution
    with torch.no_grad():
        # Its compute_embeddings through datasets.map(batched=True): 1,000 captions a call.
        for start in range(0, len(table["caption"]), 1000):
            captions = table["caption"][start : start + 1000]
            states, last_pooled = [], None
            for tokenizer, encoder in zip(tokenizers, encoders, strict=True):
                tokens = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                                   truncation=True, return_tensors="pt").input_ids
                out = encoder(tokens, output_hidden_states=True)
                last_pooled = out[0]
                states.append(out.hidden_states[-2])
            hidden.append(torch.cat(states, dim=-1))
            pooled.append(last_pooled)
        # Its compute_vae_encodings: a training batch of images a call.
        for start in range(0, len(table["filename"]), args.batch_size):
            pixels, ids = [], []
            for name in table["filename"][start : start + args.batch_size]:
                image = Image.open(os.path.join(root, name)).convert("RGB")
                w, h = image.size
                scale = size / min(w, h)
                image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR)
                left, top = (image.width - size) // 2, (image.height - size) // 2
                image = image.crop((left, top, left + size, top + size))
                pixels.append(torch.from_numpy(np.asarray(image)).permute(2, 0, 1).float() / 127.5 - 1)
                ids.append(torch.tensor([h, w, top, left, size, size], dtype=torch.float32))
            latents.append(vae.encode(torch.stack(pixels)).latent_dist.sample() * vae.config.scaling_factor)
            time_ids.append(torch.stack(ids))
    del vae, encoders  # the script frees them too
    dataset = torch.utils.data.TensorDataset(torch.cat(latents), torch.cat(hidden), torch.cat(pooled), torch.cat(time_ids))
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    params = unet.parameters()
    if args.lora_rank:  # train_dreambooth_lora_sdxl.py's adapter
        from peft import LoraConfig

        unet.requires_grad_(False)
        unet.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, init_lora_weights="gaussian",
                                    target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
        params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
    unet.train()

    step, first_step_at, timed_from = 0, None, None
    while step < args.steps:
        for x0, states, text_embeds, ids in loader:
            if first_step_at is None:
                first_step_at = time.time()
            if step == args.warmup_steps:
                timed_from = time.perf_counter()
            noise = torch.randn_like(x0)
            timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (len(x0),), device=x0.device).long()
            noisy = scheduler.add_noise(x0, noise, timesteps)
            pred = unet(noisy, timesteps, states, added_cond_kwargs={"text_embeds": text_embeds, "time_ids": ids},
                        return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(pred.float(), noise.float(), reduction="mean")
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step >= args.steps:
                break
    seconds = time.perf_counter() - timed_from
    print("BENCH " + json.dumps({"first_step_at": first_step_at, "steps_per_s": (args.steps - args.warmup_steps) / seconds,
                                 "loss": float(loss)}), flush=True)


if __name__ == "__main__":
    main()
