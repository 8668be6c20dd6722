"""Train the demo backbone on the synthetic world (`make demo-model`).

    python scripts/train_demo_model.py --out mmkv_cli/assets/demo.safetensors

Stage 1 (--vision-steps): the vision tower and projector learn to tell a frame's shape and colour
from each of its tokens (linear heads, discarded). Stage 2: clips rendered in memory from seeded
generators (the same world `mmkv synth` writes to disk), 4 to 64 frames with a curriculum, fed in
the exact prompt layout the LLaVA-OV adapter uses at encode/ask time, every question of a clip in
one row (a 4-D mask lets each see only the video and itself); the loss is on the answer words and
end-of-turn tokens. A held-out set (other seeds, 64-frame clips) is scored every --eval-every steps;
the best weights are kept. Deterministic for a given --seed and thread count. Resumes from --out +
".ckpt". On a GPU (--device cuda), --workers N renders stage-2 batches in N processes ahead of the
trainer (one core renders slower than a GPU trains), and --minutes stops, checkpointed, in time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo_batches import IGNORE, WORLD_SHAPES, Batches, stage2_batches, vision_example  # noqa: E402

from mmkv_cli.backbones.demo import demo_architecture  # noqa: E402


def multi_loss(model, ids, pixels, mask, positions, targets) -> torch.Tensor:
    """targets: [n, 3] (row, position, token): each answer token and end, where it is predicted."""
    hidden = model.model(
        input_ids=ids, pixel_values_videos=pixels, attention_mask=mask, position_ids=positions
    ).last_hidden_state
    logits = model.lm_head(hidden[targets[:, 0], targets[:, 1]]).float()
    return F.cross_entropy(logits, targets[:, 2])


def pretrain_vision(
    model,
    processor,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    device: str,
    world: str,
    place_lr: float = 1.0,
    frame_where: float = 0.0,
) -> None:
    """Stage 1: teach the vision tower + projector what each token of a frame shows (shape, colour,
    or nothing) and, on the grid world, where the token is (its quadrant), with linear heads
    discarded afterwards. Stage 2 then only has to learn to look things up, instead of learning to
    see through the answer loss alone."""
    from mmkv_cli.study.synth.world import COLOURS, SHAPES

    per_frame = WORLD_SHAPES[world][1]
    side = int(round(per_frame**0.5))
    hidden = model.config.text_config.hidden_size
    heads = torch.nn.ModuleDict(
        {
            "shape": torch.nn.Linear(hidden, len(SHAPES) + 1),
            "colour": torch.nn.Linear(hidden, len(COLOURS) + 1),
        }
    )
    if world == "grid":
        heads["quadrant"] = torch.nn.Linear(hidden, 4)
    if frame_where:
        heads["frame_where"] = torch.nn.Linear(hidden, 5)  # the shape's quadrant, or no shape
    heads = heads.to(device)
    # a token's quadrant, from its place in the row-major grid
    quadrant = torch.tensor(
        [int(k % side >= side / 2) + 2 * int(k // side >= side / 2) for k in range(per_frame)],
        device=device,
    )
    tower = {
        n: p
        for n, p in model.named_parameters()
        if "language_model" not in n and "lm_head" not in n
    }
    # Patch content outweighs the position embeddings about 100:1 at the tower's output when they
    # start from demo's (whose frames never needed a place): at the base rate they take ~1,000
    # steps to grow, so they learn faster here.
    places = [p for n, p in tower.items() if n.endswith("position_embedding.weight")]
    rest = [p for n, p in tower.items() if not n.endswith("position_embedding.weight")]
    groups = [{"params": rest + list(heads.parameters())}, {"params": places, "lr": lr * place_lr}]
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.01)
    none = (len(SHAPES), len(COLOURS))  # a token's label where no shape is
    quadrants = quadrant.repeat(batch)  # the labels of a batch's tokens, frame after frame
    rng = np.random.default_rng([seed, 99])
    for step in range(steps):
        examples = [vision_example(rng, world, per_frame) for _ in range(batch)]
        images = np.stack([image for image, _ in examples])
        pixels = processor(videos=[images], return_tensors="pt")["pixel_values_videos"][0][:, None]
        config = model.config
        feats = model.model.get_video_features(
            pixels.to(device),
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            return_dict=True,
        ).pooler_output  # [batch, tokens + newline, hidden]
        # Every token on its own must tell what it shows: the language model then finds a shape
        # by matching one token, not a sum over the frame.
        flat = feats[:, :-1].reshape(-1, feats.shape[-1])
        target = torch.tensor([label for _, labels in examples for label in labels], device=device)
        logits_s, logits_c = heads["shape"](flat), heads["colour"](flat)
        loss = F.cross_entropy(logits_s, target[:, 0]) + F.cross_entropy(logits_c, target[:, 1])
        if world == "grid":
            logits_q = heads["quadrant"](flat)
            loss = loss + F.cross_entropy(logits_q, quadrants)
        if frame_where:
            # The shape's quadrant read from the frame's *mean* token: every token carries its own
            # place, so a mean over a frame (what a diffuse attention reads) cancels it; this puts
            # the place into the tokens the shape covers, as colour is.
            shown = [
                [k for k, label in enumerate(labels) if label != none] for _, labels in examples
            ]
            where = torch.tensor([int(quadrant[k[0]]) if k else 4 for k in shown], device=device)
            logits_w = heads["frame_where"](feats[:, :-1].mean(dim=1))
            loss = loss + frame_where * F.cross_entropy(logits_w, where)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0:
            acc_s = (logits_s.argmax(-1) == target[:, 0]).float().mean().item()
            acc_c = (logits_c.argmax(-1) == target[:, 1]).float().mean().item()
            acc_q = acc_w = 1.0
            if world == "grid":
                acc_q = (logits_q.argmax(-1) == quadrants).float().mean().item()
            if frame_where:
                acc_w = (logits_w.argmax(-1) == where).float().mean().item()
            print(
                f"vision step {step + 1} loss {loss.item():.3f} shape acc {acc_s:.2f} "
                f"colour acc {acc_c:.2f} quadrant acc {acc_q:.2f} frame where acc {acc_w:.2f}",
                flush=True,
            )


def answer_logits(
    model, ids: torch.Tensor, pixels: torch.Tensor, where: torch.Tensor, span: int
) -> torch.Tensor:
    """Logits at the `span` positions from `where` on, which predict [answer..., end] in each row
    (a shorter answer's extra positions fall on padding or beyond): [B, span, vocab]."""
    hidden = model.model(input_ids=ids, pixel_values_videos=pixels).last_hidden_state
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
    at = (where.to(ids.device)[:, None] + torch.arange(span, device=ids.device)).clamp(
        max=ids.shape[1] - 1
    )
    return model.lm_head(hidden[rows, at]).float()


@torch.no_grad()
def evaluate(model, batches: Batches, seed: int, clips: int, frames: int) -> dict:
    model.eval()
    rng = np.random.default_rng(seed)
    right: dict[str, list[int]] = {}
    for start in range(0, clips, 8):
        specs = [(seed, i, frames, "mixed") for i in range(start, min(clips, start + 8))]
        ids, pixels, answers, types, where = batches.make(specs, rng)
        device = model.lm_head.weight.device
        logits = answer_logits(model, ids.to(device), pixels.to(device), where, answers.shape[1])
        guess = logits.argmax(-1).cpu()
        # right when every answer token and the end are (what greedy decoding would produce)
        whole = ((guess == answers) | (answers == IGNORE)).all(dim=1)
        for t, ok in zip(types, whole.tolist()):
            right.setdefault(t, []).append(int(ok))
    model.train()
    scores = {t: sum(v) / len(v) for t, v in sorted(right.items())}
    scores["overall"] = sum(sum(v) for v in right.values()) / sum(len(v) for v in right.values())
    return scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="mmkv_cli/assets/demo.safetensors")
    ap.add_argument(
        "--world", choices=list(WORLD_SHAPES), default="demo", help="demo, or grid (demo-grid)"
    )
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--frames", default="4,8,16,24,32,48,64", help="clip lengths drawn for training batches"
    )
    ap.add_argument(
        "--curriculum",
        type=float,
        default=0.3,
        help="share of the steps over which the longest clip drawn grows from the shortest to all",
    )
    ap.add_argument("--needle-share", type=float, default=0.35)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument(
        "--vision-steps", type=int, default=1500, help="stage 1: frame classification steps"
    )
    ap.add_argument("--vision-batch", type=int, default=128)
    ap.add_argument(
        "--place-lr",
        type=float,
        default=1.0,
        help="stage 1: the patch position embeddings' learning rate, times --lr",
    )
    ap.add_argument(
        "--frame-where",
        type=float,
        default=0.0,
        help="stage 1 (grid): weight of a head reading the shape's quadrant from a frame's mean "
        "token",
    )
    ap.add_argument(
        "--init", default=None, help="start from these weights (--vision-steps 0 skips stage 1)"
    )
    ap.add_argument(
        "--one-question", action="store_true", help="one question per clip per row (slower)"
    )
    ap.add_argument("--eval-clips", type=int, default=96)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--workers", type=int, default=0, help="processes making stage-2 batches ahead (0: none)"
    )
    ap.add_argument(
        "--minutes", type=float, default=0, help="stop after this long, checkpointed (0: no limit)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    ckpt = out.with_name(out.name + ".ckpt")
    log = out.with_name(out.stem + ".train.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)

    began = time.time()  # --minutes counts stage 1 too
    model, tokenizer, processor = demo_architecture(WORLD_SHAPES[args.world][0])
    model.to(args.device).train()
    batches = Batches(tokenizer, processor, model.config.video_token_id, args.world)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    step, best = 0, -1.0
    if ckpt.is_file():
        state = torch.load(ckpt, map_location=args.device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, best = int(state["step"]), float(state["best"])
        print(f"resumed at step {step} (best held-out {best:.3f})", flush=True)
    if step == 0 and args.init:
        load_init(model, args.init)
    if step == 0 and args.vision_steps:
        pretrain_vision(
            model,
            processor,
            args.vision_steps,
            args.vision_batch,
            args.lr,
            args.seed,
            args.device,
            args.world,
            args.place_lr,
            args.frame_where,
        )
    plan = dict(
        seed=args.seed,
        steps=args.steps,
        batch=args.batch,
        lengths=[int(x) for x in args.frames.split(",")],
        curriculum=args.curriculum,
        needle_share=args.needle_share,
        one_question=args.one_question,
    )
    started = time.time()
    for frames, tensors in stage2_batches(batches, plan, range(step, args.steps), args.workers):
        warm = min(1.0, (step + 1) / 200)
        lr = args.lr * warm * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        if args.one_question:
            ids, pixels, answers, _, where = tensors
            logits = answer_logits(
                model, ids.to(args.device), pixels.to(args.device), where, answers.shape[1]
            )
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                answers.to(args.device).reshape(-1),
                ignore_index=IGNORE,
            )
        else:
            ids, pixels, mask, positions, targets, _ = tensors
            loss = multi_loss(
                model, *(t.to(args.device) for t in (ids, pixels, mask, positions, targets))
            )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            print(
                f"step {step} loss {loss.item():.4f} lr {lr:.2e} frames {frames} "
                f"{(time.time() - started) / 60:.1f} min",
                flush=True,
            )
        out_of_time = args.minutes and time.time() - began > 60 * args.minutes
        if step % args.eval_every == 0 or step == args.steps or out_of_time:
            scores = evaluate(model, batches, seed=424242, clips=args.eval_clips, frames=64)
            with log.open("a") as fh:
                fh.write(json.dumps({"step": step, "loss": round(loss.item(), 4), **scores}) + "\n")
            print(
                f"step {step} held-out 64 frames: "
                f"{json.dumps({k: round(v, 3) for k, v in scores.items()})}",
                flush=True,
            )
            if scores["overall"] > best:
                best = scores["overall"]
                save_weights(model, out)
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "best": best},
                ckpt,
            )
        if out_of_time:
            print(f"stopped at step {step}: --minutes {args.minutes} spent (resumable)", flush=True)
            break
    print(f"done: best held-out overall {best:.3f}, weights in {out}", flush=True)


def load_init(model, path: str) -> None:
    """Start from trained weights; a vision tower trained at another frame size gets its patch
    position embeddings resized (bilinear over the patch grid), so demo's weights can start
    demo-grid: the patches see shapes at about the same scale."""
    from safetensors.torch import load_file

    weights = load_file(path)
    own = model.state_dict()
    for name, value in weights.items():
        if name.endswith("position_embedding.weight") and value.shape != own[name].shape:
            old, new = int(value.shape[0] ** 0.5), int(own[name].shape[0] ** 0.5)
            grid = value.T.reshape(1, -1, old, old)
            value = F.interpolate(grid, size=(new, new), mode="bilinear", align_corners=False)
            weights[name] = value.reshape(-1, new * new).T.contiguous()
    model.load_state_dict(weights)


def save_weights(model, out: Path) -> None:
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".part")
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(tmp))
    tmp.replace(out)


if __name__ == "__main__":
    main()
