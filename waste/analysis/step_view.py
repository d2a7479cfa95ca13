"""The step_through notebook's view: what one token did at one layer, and the widgets around it.

`layer_view(stepper, head)` gathers the numbers for the stepper's cursor (the layer the current
token has just passed): the residual-stream update of every layer so far, the KDA state of the
chosen head before and after the token and their difference, the gate exp(g) and beta, MLA
attention over the positions, every expert's router score with the chosen ones, and on K3 the
AttnRes depth-attention weights of the layer's two mixes (each labelled with the blocks of layers
it weighs, `attn_res_candidates`) beside those of every layer the token has passed.
`plot_layer_view` draws them; `StepThrough` is the notebook's control panel (container and
prompt boxes, step buttons, head and layer pickers) with its callbacks as plain methods, so a
test can drive it as a user would.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from waste.analysis.plots import KIND_COLORS
from waste.analysis.stepping import Stepper, TokenRecord, attn_res_candidates, prompt_ids
from waste.analysis.widgets import busy, progress, redraw, short_label


@dataclass
class LayerView:
    """The numbers shown for the cursor: token `record` has just passed `layer`."""

    record: TokenRecord
    layer: int
    kind: str
    head: int
    prompt_len: int
    updates: np.ndarray  # [L, 2] attention and FFN update norms; NaN for layers not reached yet
    before: np.ndarray | None = None  # KDA: [K, V] the head's state before the token
    after: np.ndarray | None = None  # KDA: [K, V] after it
    decay: np.ndarray | None = None  # KDA: [K] exp(g) of the head
    beta: np.ndarray | None = None  # KDA: [H]
    attention: np.ndarray | None = None  # MLA: [ctx] the head's probabilities over positions
    router_scores: np.ndarray | None = None  # MoE: [E]
    expert_ids: np.ndarray | None = None  # MoE: [k]
    expert_weights: np.ndarray | None = None  # MoE: [k]
    attn_res: dict[str, np.ndarray] | None = None  # K3: site -> depth-attention weights [n + 1]
    attn_res_labels: dict[str, list[str]] | None = None  # K3: site -> what each weight weighs
    # K3: [2 (layer + 1), B + 1] the weights every site so far gave each stored block (B columns,
    # b0 the embedding) and the partial sum (last column); NaN where a block was not yet a candidate.
    depth_weights: np.ndarray | None = None

    @property
    def difference(self) -> np.ndarray | None:
        """KDA: [K, V] after minus before."""
        return None if self.after is None else self.after - self.before


def layer_view(stepper: Stepper, head: int) -> LayerView:
    """The view at the stepper's cursor for one head (clipped to the layer's head count)."""
    record, layer = stepper.current, stepper.layer
    r = record.layers[layer]
    updates = np.full((stepper.num_layers, 2), np.nan)
    for x in record.layers[: layer + 1]:
        updates[x.layer] = (x.attn_update, x.ffn_update)
    view = LayerView(record, layer, r.kind, head, len(stepper.prompt), updates)
    if r.kind == "kda":
        view.head = min(head, r.state.shape[0] - 1)
        view.before = stepper.state_before(layer)[view.head]
        view.after = stepper.state_after(layer)[view.head]
        view.decay, view.beta = r.decay[view.head], r.beta
    else:
        view.head = min(head, r.attention.shape[0] - 1)
        view.attention = r.attention[view.head]
    if r.attn_res:
        view.attn_res = r.attn_res
        view.attn_res_labels, view.depth_weights = _depth(stepper, record, layer)
    if r.router_scores is not None:
        view.router_scores, view.expert_ids, view.expert_weights = r.router_scores, r.expert_ids, r.expert_weights
    return view


def _depth(stepper: Stepper, record: TokenRecord, layer: int) -> tuple[dict[str, list[str]], np.ndarray]:
    """Candidate labels of the layer's mixes, and every site's weights up to `layer` by block."""
    S = stepper.model.config.attn_res_block_size
    labels = {site: attn_res_candidates(layer, site, S) for site in record.layers[layer].attn_res}
    blocks = -(-stepper.num_layers // S)  # blocks ever stored: ceil(L / S)
    depth = np.full((2 * (layer + 1), blocks + 1), np.nan)
    for i, x in enumerate(record.layers[: layer + 1]):
        for j, site in enumerate(("attn", "ffn")):
            w = x.attn_res[site]
            depth[2 * i + j, : w.size - 1] = w[:-1]
            depth[2 * i + j, -1] = w[-1]
    return labels, depth


def plot_layer_view(view: LayerView, kinds: list[str]) -> Figure:
    """Residual updates per layer, then the layer's own panels (KDA state, gate and beta, or MLA
    attention), then the router when the layer is MoE."""
    rows = ["updates", "state", "gates"] if view.kind == "kda" else ["updates", "attention"]
    if view.attn_res:
        rows.append("attn_res")
    if view.router_scores is not None:
        rows.append("router")
    heights = {"updates": 2.6, "state": 3.6, "gates": 2.6, "attention": 2.8, "attn_res": 3.2, "router": 2.6}
    fig = Figure(figsize=(12, sum(heights[r] for r in rows)), layout="constrained")
    subs = fig.subfigures(len(rows), 1, squeeze=False, height_ratios=[heights[r] for r in rows])[:, 0]
    for sub, row in zip(subs, rows, strict=True):
        {"updates": _updates, "state": _state, "gates": _gates, "attention": _attention, "attn_res": _attn_res,
         "router": _router}[row](sub, view, kinds)
    phase = "generated" if view.record.generated else "prompt"
    fig.suptitle(f"position {view.record.position} ({phase} token {view.record.token}) after layer {view.layer} "
                 f"({view.kind.upper()}), head {view.head}")
    return fig


def _updates(sub: Any, view: LayerView, kinds: list[str]) -> None:
    ax = sub.subplots()
    x = np.arange(len(kinds))
    attn, ffn = np.nan_to_num(view.updates[:, 0]), np.nan_to_num(view.updates[:, 1])
    ax.bar(x, attn, color=[KIND_COLORS[k] for k in kinds], label="attention (KDA blue, MLA orange)")
    bars = ax.bar(x, ffn, bottom=attn, color="#9467bd", label="FFN (dense or MoE)")
    bars[view.layer].set_edgecolor("black")
    bars[view.layer].set_linewidth(2)
    ax.set_xticks(x, [f"{i}\n{k}" for i, k in enumerate(kinds)])
    ax.set_xlabel("layer (0-based) and kind; layers the token has not reached yet are empty")
    ax.set_ylabel("L2 norm of the update")
    ax.set_title("each layer's update to the residual stream for this token")
    ax.legend(fontsize="small")


def _heatmap(ax: Any, values: np.ndarray, title: str, lim: float) -> Any:
    im = ax.imshow(values, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest", aspect="auto")
    ax.set_title(title)
    ax.set_xlabel("V index")
    ax.set_ylabel("K index")
    return im


def _state(sub: Any, view: LayerView, kinds: list[str]) -> None:
    axes = sub.subplots(1, 3)
    lim = float(max(np.abs(view.before).max(), np.abs(view.after).max())) or 1.0
    _heatmap(axes[0], view.before, "state before the token", lim)
    im = _heatmap(axes[1], view.after, "state after", lim)
    sub.colorbar(im, ax=list(axes[:2]), label="state value")
    diff = view.difference
    im = _heatmap(axes[2], diff, "after minus before", float(np.abs(diff).max()) or 1.0)
    sub.colorbar(im, ax=axes[2], label="change (own scale)")
    sub.suptitle(f"KDA state S [K, V] of head {view.head} at layer {view.layer}")


def _gates(sub: Any, view: LayerView, kinds: list[str]) -> None:
    left, right = sub.subplots(1, 2, width_ratios=[2, 1])
    left.bar(np.arange(view.decay.size), view.decay, color="#1f77b4")
    left.set_ylim(0, 1.02)
    left.set_xlabel("K channel")
    left.set_ylabel("decay exp(g): fraction kept")
    left.set_title(f"gate of head {view.head}: how much of each state row survives")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    colors = ["#d62728" if h == view.head else "#1f77b4" for h in range(view.beta.size)]
    right.bar(np.arange(view.beta.size), view.beta, color=colors)
    right.set_ylim(0, 1)
    right.set_xlabel("head (chosen one red)")
    right.set_ylabel("beta (write strength)")
    right.set_title("beta per head")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))


def _attention(sub: Any, view: LayerView, kinds: list[str]) -> None:
    ax = sub.subplots()
    a = view.attention
    positions = np.arange(a.size)
    colors = ["#7f7f7f" if p < view.prompt_len else "#2ca02c" for p in positions]
    ax.bar(positions, a, color=colors)
    if view.prompt_len < a.size:
        ax.axvline(view.prompt_len - 0.5, color="black", linestyle="--", label="prompt | generated")
        ax.legend(fontsize="small")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(-0.5, a.size - 0.5)
    ax.set_xlabel("position attended to (prompt grey, generated green; the token itself last)")
    ax.set_ylabel("attention probability")
    ax.set_title(f"MLA attention of head {view.head} at layer {view.layer}")


def _attn_res(sub: Any, view: LayerView, kinds: list[str]) -> None:
    """Left: the weights of this layer's two mixes by candidate; right: every layer's so far."""
    ax, right = sub.subplots(1, 2, width_ratios=[3, 2]) if view.depth_weights is not None else (sub.subplots(), None)
    sites = list(view.attn_res)
    longest = max(sites, key=lambda site: view.attn_res[site].size)
    n = view.attn_res[longest].size
    width = 0.8 / len(sites)
    for j, site in enumerate(sites):
        w = view.attn_res[site]
        ax.bar(np.arange(w.size) + (j - (len(sites) - 1) / 2) * width, w, width=width,
               label=f"input of the {'attention' if site == 'attn' else 'FFN'}")
    names = [f"b{i}" for i in range(n - 1)] + ["p"]
    if view.attn_res_labels:
        names = [f"{b}\n{label}" for b, label in zip(names, view.attn_res_labels[longest], strict=True)]
    ax.set_xticks(range(n), names)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("candidate: stored blocks b0.. (b0 the embedding, then the layers each block sums), "
                  "last the running partial sum p")
    ax.set_ylabel("depth-attention weight")
    ax.set_title(f"AttnRes: how layer {view.layer} mixes the residual blocks for this token")
    ax.legend(fontsize="small")
    if right is not None:
        depth = view.depth_weights
        im = right.imshow(depth, cmap="viridis", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        right.set_xticks(range(depth.shape[1]), [f"b{i}" for i in range(depth.shape[1] - 1)] + ["p"])
        rows = [f"{i} {site}" for i in range(depth.shape[0] // 2) for site in ("attn", "FFN")]
        right.set_yticks(range(depth.shape[0]), rows, fontsize="small")
        right.set_ylabel("layer and site")
        right.set_title("which blocks every layer so far reads from (blank: not yet stored)")
        sub.colorbar(im, ax=right, label="weight")


def _router(sub: Any, view: LayerView, kinds: list[str]) -> None:
    ax = sub.subplots()
    scores = view.router_scores
    chosen = {int(e): float(w) for e, w in zip(view.expert_ids, view.expert_weights, strict=True)}
    colors = ["#d62728" if e in chosen else "#c7c7c7" for e in range(scores.size)]
    ax.bar(np.arange(scores.size), scores, color=colors)
    for e, w in chosen.items():
        ax.annotate(f"{w:.2f}", (e, scores[e]), ha="center", va="bottom", fontsize="small")
    ax.set_ylim(0, 1.1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("expert (chosen red, labelled with its routing weight)")
    ax.set_ylabel("router score sigmoid(x W)")
    ax.set_title(f"router scores of every expert at layer {view.layer}")


def top_k_table(record: TokenRecord, tokenizer: Any | None, k: int = 5) -> str:
    """The likeliest next tokens after `record` (its logits after every layer), as text lines."""
    lines = [f"next token after position {record.position} (after all layers):"]
    for token, p in record.top_k(k):
        text = f"  {tokenizer.token_text(token)!r}" if tokenizer is not None else ""
        lines.append(f"  {token:>7d}{text}  p = {p:.3f}")
    return "\n".join(lines)


class StepThrough:
    """The step_through notebook's controls; each button's callback is a method a test can call."""

    def __init__(self, containers: list[str], prompt_text: str, *, steps_ahead: int = 0):
        import ipywidgets as w

        self.container_box = w.Combobox(value=containers[0], options=containers, description="container",
                                        layout=w.Layout(width="60%"), ensure_option=False)
        self.prompt_box = w.Text(value=prompt_text, description="prompt", layout=w.Layout(width="60%"))
        self.load_button = w.Button(description="Load", icon="refresh")
        self.back_button = w.Button(description="◀ layer")
        self.forward_button = w.Button(description="layer ▶")
        self.prev_token_button = w.Button(description="◀◀ token")
        self.next_token_button = w.Button(description="token ▶▶")
        self.head_slider = w.IntSlider(value=0, min=0, max=0, description="head", continuous_update=False)
        self.layer_slider = w.IntSlider(value=0, min=0, max=0, description="layer", continuous_update=False)
        self.status = w.HTML()
        self.out = w.Output()
        self.buttons = [self.load_button, self.back_button, self.forward_button, self.prev_token_button,
                        self.next_token_button, self.head_slider, self.layer_slider]
        self.load_button.on_click(lambda _: self.load())
        self.back_button.on_click(lambda _: self.back())
        self.forward_button.on_click(lambda _: self.forward())
        self.prev_token_button.on_click(lambda _: self.prev_token())
        self.next_token_button.on_click(lambda _: self.next_token())
        self.head_slider.observe(lambda _: self.render(), names="value")
        self.layer_slider.observe(self._on_layer_slider, names="value")
        self.stepper: Stepper | None = None
        self.tokenizer: Any | None = None
        self.figure: Figure | None = None
        self.view: LayerView | None = None
        self._container: Any = None
        self._steps_ahead = steps_ahead
        self._quiet = False
        self._load()

    def widget(self) -> Any:
        import ipywidgets as w

        return w.VBox([w.HBox([self.container_box, self.load_button]), self.prompt_box,
                       w.HBox([self.prev_token_button, self.back_button, self.forward_button,
                               self.next_token_button]),
                       w.HBox([self.layer_slider, self.head_slider]), self.status, self.out])

    def load(self) -> None:
        """The Load button: like `_load`, but a bad path or prompt shows in the status line (and the
        view stays as it was) instead of raising."""
        from waste.errors import WasteError

        try:
            self._load()
        except WasteError as e:
            self.status.value = f"<span style='color:#d62728'>{html.escape(str(e))}</span>"

    def _load(self) -> None:
        """Open the chosen container, encode the prompt, feed it (and `steps_ahead` tokens) through."""
        from waste.container.reader import open_container
        from waste.engine.model import Model
        from waste.tokenizer import container_tokenizer

        with busy(self.buttons):
            path = Path(self.container_box.value)
            container = open_container(path)
            try:
                model = Model(container)
                tokenizer = container_tokenizer(container)
                ids = prompt_ids(self.prompt_box.value, tokenizer, model.config.vocab_size)
            except BaseException:
                container.close()
                raise
            if self._container is not None:
                self._container.close()
            self._container, self.tokenizer = container, tokenizer
            self.stepper = Stepper(model, ids)
            total = len(ids) + self._steps_ahead
            with progress(total, "feeding tokens") as bar:
                for _ in range(total):
                    self.stepper.feed()
                    bar.update()
            self.stepper.goto(0, 0)
            self.kinds = list(model.config.layer_kinds)
            self._quiet = True
            self.layer_slider.max = len(self.kinds) - 1
            self.layer_slider.value = 0
            self.head_slider.max = max(model.config.kda_num_heads, model.config.mla_num_heads) - 1
            self._quiet = False
            self.label = short_label(path)
        self.render()

    def _move(self, step: Any) -> None:
        with busy(self.buttons):
            step()
            self._quiet = True
            self.layer_slider.value = self.stepper.layer
            self._quiet = False
        self.render()

    def forward(self) -> None:
        """One layer on (a new token after the last layer)."""
        self._move(self.stepper.forward)

    def back(self) -> None:
        self._move(self.stepper.back)

    def next_token(self) -> None:
        """The same layer of the next position."""
        s = self.stepper
        self._move(lambda: s.goto(s.position + 1, s.layer))

    def prev_token(self) -> None:
        s = self.stepper
        self._move(lambda: s.goto(max(s.position - 1, 0), s.layer))

    def goto(self, position: int, layer: int) -> None:
        """Put the cursor at (position, layer) and redraw."""
        self._move(lambda: self.stepper.goto(position, layer))

    def _on_layer_slider(self, change: dict[str, Any]) -> None:
        if not self._quiet:
            self._move(lambda: self.stepper.goto(self.stepper.position, int(change["new"])))

    def render(self) -> None:
        """Redraw the view at the cursor in place."""
        if self._quiet or self.stepper is None:
            return
        from IPython.display import display

        self.view = layer_view(self.stepper, self.head_slider.value)
        record = self.view.record
        text = repr(self.tokenizer.token_text(record.token)) if self.tokenizer is not None else ""
        phase = "generated" if record.generated else "prompt"
        self.status.value = (f"<b>{self.label}</b>: position {record.position} of {len(self.stepper.records)} fed "
                             f"({phase} token {record.token} {text}), layer {self.view.layer} "
                             f"{self.view.kind.upper()}, update norm {record.layers[self.view.layer].update_norm:.3f}")
        self.figure = plot_layer_view(self.view, self.kinds)
        table = top_k_table(record, self.tokenizer)

        def draw() -> None:
            print(table)
            display(self.figure)

        redraw(self.out, draw)


def step_conclusion(stepper: Stepper) -> str:
    """A few sentences drawn from every record fed so far (markdown)."""
    records = stepper.records
    updates = np.array([r.update_norms for r in records])  # [positions, L]
    kinds = list(stepper.model.config.layer_kinds)
    mean = updates.mean(axis=0)
    top = int(np.argmax(mean))
    kda = [i for i, k in enumerate(kinds) if k == "kda"]
    mla = [i for i, k in enumerate(kinds) if k == "mla"]
    lines = [f"**Conclusion.** {len(records)} positions were stepped ({len(stepper.prompt)} prompt, "
             f"{sum(r.generated for r in records)} generated). Layer {top} ({kinds[top].upper()}) makes the largest "
             f"update to the residual stream on average (norm {mean[top]:.2f}; the smallest is layer "
             f"{int(np.argmin(mean))}, {mean.min():.2f})."]
    if kda:
        beta = np.mean([r.layers[i].beta.mean() for r in records for i in kda])
        kept = np.mean([r.layers[i].decay.mean() for r in records for i in kda])
        lines.append(f"KDA layers write with mean beta {beta:.2f} and keep on average {kept:.0%} of each state row "
                     f"per token (the mean decay exp(g)).")
    generated = [r for r in records if r.generated]
    if mla and generated:
        share = np.mean([r.layers[i].attention[:, : len(stepper.prompt)].sum(axis=1).mean()
                         for r in generated for i in mla])
        lines.append(f"At generated positions the MLA heads put {share:.0%} of their attention on the prompt.")
    if records[0].output_attn_res is not None:
        # Every mix's weights: the last one is the partial sum p, the first the embedding b0.
        mixes = [w for r in records for x in r.layers for w in x.attn_res.values() if w.size > 1]
        mixes += [r.output_attn_res for r in records]
        partial = np.mean([w[-1] for w in mixes])
        embedding = np.mean([w[0] for w in mixes])
        lines.append(f"AttnRes: over the {len(mixes)} depth-attention mixes with a choice, the running partial "
                     f"sum got {partial:.0%} of the weight on average, the embedding block b0 {embedding:.0%} and "
                     f"the closed blocks between them {1 - partial - embedding:.0%}.")
    return " ".join(lines)
