"""With MTP heads the training loss adds their term, while the eval loss is the language model's alone:
the progress line and the curves set the eval loss against the train LM loss, not the total."""

from __future__ import annotations

from deltamoe.train.progress import RunProgress


def test_the_progress_line_shows_the_lm_part_of_a_loss_with_an_mtp_term():
    progress = RunProgress(total=10, start=0, enabled=False)
    progress.update(1, {"loss": 3.0876, "lm_loss": 2.3750, "tokens_per_s": 100.0})
    assert progress._status.startswith("loss 3.0876 (lm 2.3750)")
    progress.update(2, {"loss": 2.5, "lm_loss": 2.5, "tokens_per_s": 100.0})  # no MTP: one number
    assert progress._status.startswith("loss 2.5000  ")


def test_the_curves_draw_the_train_lm_loss_beside_the_eval_loss(tmp_path, monkeypatch):
    import matplotlib.axes

    from deltamoe.train.plots import plot_curves

    drawn = []
    real_plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *a, **kw: drawn.append((kw.get("label"), list(a[1]))) or real_plot(self, *a, **kw))
    metrics = [{"step": s, "loss": 3.0 - 0.1 * s, "lm_loss": 2.4 - 0.1 * s} for s in range(1, 4)]
    plot_curves(metrics, [{"step": 3, "loss": 2.1}], tmp_path / "curves.png")
    curves = dict(drawn)
    assert curves["train LM loss"] == [m["lm_loss"] for m in metrics]
    assert curves["train loss (LM + MTP)"] == [m["loss"] for m in metrics]
    assert curves["eval loss (LM)"] == [2.1] and (tmp_path / "curves.png").is_file()
