"""Train the demo backbone on the synthetic world (`make demo-model`).

    python scripts/train_demo_model.py --out mmkv_cli/assets/demo.safetensors

Stage 1 (--vision-steps): the vision tower and projector learn to tell a frame's shape and colour
from each of its tokens (linear heads, discarded). Stage 2: clips rendered in memory from seeded
generators (the same world `mmkv synth` writes to disk), 4 to 64 frames with a curriculum, fed in
the exact prompt layout the LLaVA-OV adapter uses at encode/ask time, every question of a clip in
one row (a 4-D mask lets each see only the video and itself); the loss is on the answer words and
end-of-turn tokens. A held-out set (other seeds, 64-frame clips) is scored every --eval-every steps;
the best weights are kept. Deterministic for a given --seed and thread count. Resumes from --out +
".ckpt".
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

from mmkv_cli.backbones.demo import FRAME_SIDE, GRID_SIDE, demo_architecture  # noqa: E402
from mmkv_cli.backbones.llava_onevision import PROMPT  # noqa: E402
from mmkv_cli.synth import make_clip, render_frames  # noqa: E402
from mmkv_cli.synth.world import Clip, Event  # noqa: E402

# world -> (frame side the vision tower sees, tokens a frame becomes)
WORLD_SHAPES = {"demo": (FRAME_SIDE, 4), "grid": (GRID_SIDE, 16)}
IGNORE = -100  # padding of answers shorter than the batch's longest


class Batches:
    """Prompt ids, pixels and answer ids for clips drawn from a seeded stream."""

    def __init__(self, tokenizer, processor, video_id: int, world: str = "demo"):
        self.tokenizer, self.processor, self.video_id = tokenizer, processor, video_id
        self.world = world
        self.per_frame = WORLD_SHAPES[world][1]
        self.prefix = self.ids(PROMPT.prefix)
        self.end = self.ids("<|im_end|>")

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def make(self, specs: list[tuple[int, int, int, str]], rng: np.random.Generator):
        """specs: (seed, index, frames, kind); all the same frame count. One random question per
        clip.

        A moment question sees the clip up to its moment, so the clip is cut there (and moved later
        by blank frames, so every clip of the batch still has `frames` frames).
        """
        frames = specs[0][2]
        videos, rows, answers, types = [], [], [], []
        for seed, index, count, kind in specs:
            clip, qa = make_clip(seed, index, count, kind, self.world)
            q = qa[int(rng.integers(len(qa)))]
            if q["type"] == "moment":  # cut at the moment, blank frames first: same batch length
                clip = truncated(clip, q["frame"] + 1)
                clip = shifted(clip, count - clip.frames)
            videos.append(render_frames(clip, self.world))
            answer = self.ids(q["answer"]) + self.end  # answers are one or two words
            rows.append(
                self.prefix
                + [self.video_id] * (frames * self.per_frame + 1)
                + self.ids(PROMPT.question.format(question=q["question"]))
                + answer
            )
            answers.append(answer)
            types.append(q["type"])
        pixels = self.processor(videos=videos, return_tensors="pt")["pixel_values_videos"]
        # Questions differ in length: pad after the end token (causal attention never looks right),
        # and remember where each row's answer is predicted from.
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        where = torch.tensor([len(r) - len(a) - 1 for r, a in zip(rows, answers)])
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        longest = max(len(a) for a in answers)
        padded = torch.tensor([a + [IGNORE] * (longest - len(a)) for a in answers])
        return ids, pixels, padded, types, where

    def make_multi(self, specs: list[tuple[int, int, int, str]], rng: np.random.Generator):
        """Every question of each clip in one row: [prompt | video | q1 a1 | q2 a2 | ...], each
        question seeing the video and itself only (a 4-D mask) and starting at the same position, as
        if asked alone. One forward supervises all of a clip's answers. Moment questions need a cut
        clip: a clip drawn for one of those carries only it."""
        frames = specs[0][2]
        video_len = len(self.prefix) + frames * self.per_frame + 1
        videos, rows, blocks, targets, types = [], [], [], [], []
        for seed, index, count, kind in specs:
            clip, qa = make_clip(seed, index, count, kind, self.world)
            if kind == "normal" and rng.random() < 1 / 6:
                q = next(x for x in qa if x["type"] == "moment")
                clip = shifted(truncated(clip, q["frame"] + 1), count - q["frame"] - 1)
                asked = [q]
            else:
                asked = [x for x in qa if x["type"] != "moment"]
            videos.append(render_frames(clip, self.world))
            row = self.prefix + [self.video_id] * (frames * self.per_frame + 1)
            spans = []
            for q in asked:
                asking = self.ids(PROMPT.question.format(question=q["question"]))
                answer = self.ids(q["answer"]) + self.end
                turn = asking + answer
                spans.append((len(row), len(row) + len(turn)))
                # every answer token and the end, each predicted from the position before it
                first = len(row) + len(asking) - 1
                targets += [(len(rows), first + t, token) for t, token in enumerate(answer)]
                types.append(q["type"])
                row = row + turn
            rows.append(row)
            blocks.append(spans)
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id)
        mask = torch.zeros(len(rows), 1, width, width, dtype=torch.bool)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        for r, (row, spans) in enumerate(zip(rows, blocks)):
            ids[r, : len(row)] = torch.tensor(row)
            mask[r, 0, :video_len, :video_len] = causal[:video_len, :video_len]
            positions[r, :video_len] = torch.arange(video_len)
            for a, b in spans:
                mask[r, 0, a:b, :video_len] = True
                mask[r, 0, a:b, a:b] = causal[: b - a, : b - a]
                positions[r, a:b] = torch.arange(video_len, video_len + b - a)
            mask[r, 0, len(row) :, :] = causal[len(row) :, :]  # padding rows: anything valid
        pixels = self.processor(videos=videos, return_tensors="pt")["pixel_values_videos"]
        return ids, pixels, mask, positions, torch.tensor(targets), types


def truncated(clip: Clip, frames: int) -> Clip:
    """The clip as seen up to (not including) frame `frames`: what a question asked at that moment
    sees."""
    kept = tuple(
        Event(e.shape, e.colour, e.start, min(e.stop, frames), e.x0, e.y0, e.vx, e.vy)
        for e in clip.events
        if e.start < frames
    )
    return Clip(clip.kind, frames, kept)


def multi_loss(model, ids, pixels, mask, positions, targets) -> torch.Tensor:
    """targets: [n, 3] (row, position, token): each answer token and end, where it is predicted."""
    hidden = model.model(
        input_ids=ids, pixel_values_videos=pixels, attention_mask=mask, position_ids=positions
    ).last_hidden_state
    logits = model.lm_head(hidden[targets[:, 0], targets[:, 1]]).float()
    return F.cross_entropy(logits, targets[:, 2])


def vision_example(rng: np.random.Generator, world: str, per_frame: int):
    """One frame and, for each of its tokens, (shape, colour) or "none" (the last index of each):
    the demo world's shape fills every token; a grid shape only those it covers."""
    from mmkv_cli.synth import grid
    from mmkv_cli.synth.world import COLOURS, SHAPES, render

    empty = rng.random() < 0.1
    none = (len(SHAPES), len(COLOURS))
    if world == "grid":
        s, c = int(rng.integers(len(SHAPES))), int(rng.integers(len(COLOURS)))
        event = grid.placed(rng, SHAPES[s], list(COLOURS)[c], 0, 1)
        clip = Clip("normal", 1, () if empty else (event,))
        covered = set() if empty else set(grid.covered_tokens(event, 0))
        labels = [(s, c) if k in covered else none for k in range(per_frame)]
        return grid.render_grid(clip, 0), labels
    if empty:
        return render(Clip("normal", 1, ()), 0), [none] * per_frame
    s, c = int(rng.integers(len(SHAPES))), int(rng.integers(len(COLOURS)))
    x, y = float(rng.uniform(0.35, 0.65)), float(rng.uniform(0.35, 0.65))
    event = Event(SHAPES[s], list(COLOURS)[c], 0, 1, x, y, 0.0, 0.0)
    return render(Clip("normal", 1, (event,)), 0), [(s, c)] * per_frame


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
    from mmkv_cli.synth.world import COLOURS, SHAPES

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


def shifted(clip, frames: int):
    """The clip with `frames` empty frames before it."""
    from mmkv_cli.synth.world import Clip, Event

    events = tuple(
        Event(e.shape, e.colour, e.start + frames, e.stop + frames, e.x0, e.y0, e.vx, e.vy)
        for e in clip.events
    )
    return Clip(clip.kind, clip.frames + frames, events)


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
        guess = answer_logits(model, ids, pixels, where, answers.shape[1]).argmax(-1)
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
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    ckpt = out.with_name(out.name + ".ckpt")
    log = out.with_name(out.stem + ".train.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)

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
    lengths = [int(x) for x in args.frames.split(",")]
    started = time.time()
    while step < args.steps:
        rng = np.random.default_rng(
            [args.seed, step]
        )  # a step's batch depends on the step only: resumable
        # Curriculum: short clips first (visual features and lookups are learnt cheaply), then
        # longer ones.
        grown = min(1.0, step / max(1, args.curriculum * args.steps))
        allowed = lengths[: max(1, math.ceil(grown * len(lengths)))]
        frames = int(rng.choice(allowed))
        specs = [
            (
                args.seed * 1_000_003 + step,
                b,
                frames,
                "needle" if frames >= 16 and rng.random() < args.needle_share else "normal",
            )
            for b in range(args.batch)
        ]
        warm = min(1.0, (step + 1) / 200)
        lr = args.lr * warm * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        if args.one_question:
            ids, pixels, answers, _, where = batches.make(specs, rng)
            logits = answer_logits(
                model, ids.to(args.device), pixels.to(args.device), where, answers.shape[1]
            )
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                answers.to(args.device).reshape(-1),
                ignore_index=IGNORE,
            )
        else:
            ids, pixels, mask, positions, targets, _ = batches.make_multi(specs, rng)
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
        if step % args.eval_every == 0 or step == args.steps:
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
