"""LocalSGD, written for Accelerate as its ``examples/by_feature/local_sgd.py`` uses it, in the
form of Accelerate's test scripts (a ``main`` calling test functions), run by `runner` under
both frameworks beside Accelerate's own scripts: inside the block the processes' parameters
drift apart (no gradient synchronisation), every `local_sgd_steps` optimizer steps and on
leaving the block they become the mean of every process's parameters."""

import torch

from accelerate import Accelerator
from accelerate.local_sgd import LocalSGD
from accelerate.utils import gather


def snapshot(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def test_local_sgd_averages_every_k_steps(accelerator, steps=2):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    n = accelerator.num_processes
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=steps) as local_sgd:
        for step in range(1, 5):
            torch.manual_seed(100 + 10 * step + accelerator.process_index)  # each its own data
            x, y = torch.randn(8, 4), torch.randn(8, 2)
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            before = gather(snapshot(model)[None])  # every process's, before averaging
            local_sgd.step()
            after = gather(snapshot(model)[None])
            if n > 1 and step % steps == 0:
                torch.testing.assert_close(after[0], before.mean(0), rtol=1e-6, atol=1e-7)
                assert torch.equal(after[0], after[1])
            elif n > 1:
                assert not torch.equal(after[0], after[1])  # drifted apart
                assert torch.equal(after, before)


def main():
    accelerator = Accelerator(cpu=True)
    test_local_sgd_averages_every_k_steps(accelerator)
    accelerator.end_training()


if __name__ == "__main__":
    main()
