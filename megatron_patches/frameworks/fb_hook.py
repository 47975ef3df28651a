"""Replace a framework module's `get_forward_backward_func` by one whose result is wrapped
(NeMo-RL, ROLL): the wrapper dispatches each call to reuse or to Megatron's own schedule.
Installing twice is a no-op; uninstall restores the stock function."""

__all__ = ["wrap_forward_backward_func", "unwrap_forward_backward_func"]


def wrap_forward_backward_func(module, dispatch) -> None:
    """module.get_forward_backward_func(...) returns dispatch(stock(...)) from now on."""
    if getattr(module.get_forward_backward_func, "_prefix_reuse", False):
        return
    stock = module.get_forward_backward_func

    def get_forward_backward_func_with_reuse(*a, **kw):
        return dispatch(stock(*a, **kw))
    get_forward_backward_func_with_reuse._prefix_reuse = True
    get_forward_backward_func_with_reuse._stock = stock
    module.get_forward_backward_func = get_forward_backward_func_with_reuse


def unwrap_forward_backward_func(module) -> None:
    stock = getattr(module.get_forward_backward_func, "_stock", None)
    if stock is not None:
        module.get_forward_backward_func = stock
