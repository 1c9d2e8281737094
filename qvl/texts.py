"""Every sentence a user can read, in English and Simplified Chinese: the page's labels and the server's messages.

The page's labels reach the browser through Gradio's i18n (ui.I18N) and are translated there; the server's messages
(errors, place in line, stats) are filled in on the server for the browser's language with say(). Library wording
(PIL's, Gradio's) never reaches the user: it goes to the log.
"""

TEXT = {
    "en": {
        "title": "## Chat about images with Qwen3-VL, on a CPU",
        "fallback": "⚠ **Offline fallback**: the real model could not be loaded, so a tiny random model is "
                    "answering: its answers are gibberish.",
        "warming": "⏳ Warming up: the model is getting ready. Questions asked now wait in line and are answered "
                   "as soon as it is.",
        "start_reading": "Reading the model: {done}",
        "start_converting": "Converting the model for this CPU, which only a first start does: {done}",
        "start_loading": "Loading the model…",
        "start_warming": "Warming up: answering a first question…",
        "start_connecting": "Asking the model server which model it serves…",
        "chat": "Chat", "settings": "Settings", "conversation": "Conversation",
        "placeholder": "Ask about your images… (Enter sends, Shift+Enter for a new line)",
        "welcome": "### Ask anything about a picture\n\nAdd one or more images (upload, drag and drop or paste), "
                   "type a question and press Enter. The answer is written live by this machine's CPU.\n\n"
                   "Or start with one of these:",
        "example_chart": "Which fruit sold the most, and how many more boxes than the least popular one?",
        "example_receipt": "What is the total on this receipt, and which item cost the most?",
        "example_scene": "Describe this picture in one sentence.",
        "example_shapes": "Outline every red circle and label it: give each one's bbox_2d in JSON.",
        "threads": "Intra-op threads (whole server, applies at once)",
        "generation": "### Generation (your session only)",
        "max_image_tokens": "Max image tokens (fewer is faster, more sees finer detail)",
        "max_video_frames": "Max video frames (2 a second; each pair costs an image's tokens)",
        "max_new_tokens": "Max new tokens", "temperature": "Temperature", "top_p": "Top-p", "top_k": "Top-k",
        "greedy": "Greedy (deterministic; ignores temperature, top-p, top-k)", "seed": "Seed",
        "cache": "### Answer cache", "use_cache": "Answer my repeated questions from the cache",
        "cache_clear": "Clear the cache…", "cache_confirm": "Delete every cached answer, for every visitor?",
        "cache_yes": "Yes, clear it", "cancel": "Cancel", "refresh": "Refresh",
        "server": "This server",
        "operator_only": "Server-wide settings (threads, clearing the cache) are for the operator of this server.",
        # Filled in on the server for the browser's language, so they carry placeholders.
        "waiting": "Waiting in line: {ahead} request(s) ahead of you…",
        "busy": "The server is busy ({size} requests are already waiting). Please try again shortly.",
        "one_at_a_time": "You already have a question waiting or being answered: one at a time, please. Ask again "
                         "once its answer is done (or stop it).",
        "failed": "Something went wrong while answering. Please try again.",
        "not_operator": "Only the operator of this server can change this.",
        "stopped": "stopped",
        "drawn": "The answer's boxes and points, drawn on the image",
        "no_answer": "(the model gave no answer: rephrase the question, or press Retry for another try)",
        "thinking": "Thinking", "thought_for": "thought for {seconds:.1f} s",
        "thought_cut": "(the model was still thinking when it reached the max-new-tokens limit, so it gave no answer: "
                       "raise Max new tokens in Settings and ask again)",
        "forgotten": "⚠ The server no longer remembers the earlier messages (many visitors came after your last "
                     "one), so this starts a new conversation.",
        "forgotten_asked": "⚠ The server forgot this conversation before it could answer (many visitors at once): "
                           "please send your question again.",
        "stats": "first token {ttft:.2f} s · {tps:.1f} tok/s · {image_tokens} image tokens · {total:.1f} s total",
        "from_cache": "answered from cache in {elapsed:.2f} s (first computed in {total:.1f} s)",
        "truncated": "hit the max-new-tokens limit",
        "reused": "{tokens} of {prompt} prompt tokens reused", "features_cached": "image features from cache ({count})",
        "batch_part": "decoded in a batch of {count}",
        "memory_line": "Conversation memory: {state} · {entries} kept · {size:.0f} of {limit:.0f} MB · "
                       "{hits} hits · {reused} prompt tokens reused\n\nImage features: {features} · {feature_hits} hits",
        "features_line": "{memory} in memory, {disk} on disk", "memory_off": "off",
        "cache_line": "Answer cache: {state} · {entries} answers · {size:.1f} MB · {hits} hits · {misses} misses",
        "on": "on", "off": "off", "broken": "unusable, answering without it",
        "fact_model": "Model", "fact_precision": "Precision / quantization", "fact_threads": "Threads",
        "fact_threads_value": "{threads} intra-op · {interop} inter-op (fixed at start-up) · {cores} cores available",
        "fact_cpu": "CPU", "fact_versions": "Versions", "fact_fallback": "Fallback reason",
        "fact_cache_dir": "Answer cache folder",
        # What the operator reads for each precision of qvl.engine.modes (the log and the cache key keep modes.describe's).
        "precision_int8": "int8: int8 weights and activations (fbgemm, a scale per token) in every linear and the "
                          "head, loud text channels computed apart, token table in bf16",
        "precision_w8a14": "w8a14: as int8, but each decode row's activations in two int8 parts (14 bits), and the "
                           "first text layers' weights too",
        "precision_int4": "int4: text weights in int4 for decoding (int8 for prompts), vision tower in int8, a scale "
                          "per token, loud text channels computed apart, token table in bf16",
        "precision_w8a16": "w8a16: int8 weights (a scale per row) with bf16 activations in every linear and the head, "
                           "loud text channels computed apart, token table in bf16",
        "precision_remote": "answered by the model server at {detail}",
        # The user's input, refused with what to do about it.
        "not_found": "{name}: file not found; please upload it again.",
        "empty_file": "{name} is empty; please upload a picture (PNG, JPEG, WebP, GIF), a video (MP4, WebM, MOV) or a "
                      "PDF.",
        "not_image": "{name} is not a picture this app can read; please upload a picture (PNG, JPEG, WebP, GIF), a "
                     "video (MP4, WebM, MOV) or a PDF.",
        "damaged": "{name} is damaged or truncated; please upload a complete image.",
        "too_many_pixels": "{name} has {size} pixels; images up to {limit} megapixels are accepted. "
                           "Please downscale it first.",
        "far_too_many": "far too many",
        "file_too_big": "{name} is larger than {limit}; please upload a smaller picture.",
        # PDFs (qvl/documents.py) and videos (qvl/video.py).
        "pdf_damaged": "{name} is not a PDF this app can read (damaged, truncated or not a PDF at all); please upload "
                       "a complete PDF, or a picture of the page.",
        "pdf_locked": "{name} is password-protected; please upload a PDF without a password, or a picture of the page.",
        "pdf_too_many_pages": "{name} has {pages} pages; PDFs of up to {limit} pages are accepted. Please upload only "
                              "the pages you are asking about.",
        "video_damaged": "{name} is not a video this app can read (damaged, truncated or not a video at all); please "
                         "upload a complete MP4, WebM or MOV clip.",
        "video_audio_only": "{name} holds only sound; this app answers about pictures and video, not audio.",
        "video_too_long": "{name} lasts {seconds} s; videos of up to {limit} s are accepted. Please cut out the part "
                          "you are asking about.",
        "video_part": "video: {frames} frames, {tokens} tokens",
        "empty_question": "Please type a question or add an image.",
        "bad_role": "Unknown role {role!r}: each turn is 'system', 'user' or 'assistant'.",
        "ends_with_user": "The conversation must end with a user message.",
        "too_long": "This conversation needs {needed} tokens{images}, over the limit of {limit} tokens. "
                    "Clear the conversation, send fewer or smaller images, or lower 'Max image tokens' in Settings.",
        "too_long_model": "This conversation needs {needed} tokens{images}, but this model handles at most {limit}. "
                          "Clear the conversation, send fewer or smaller images, or lower 'Max image tokens' in "
                          "Settings.",
        "image_share": " ({tokens} of them for {count} {pictures})",
        "picture": "image", "pictures": "images",
        # The OpenAI-compatible API's own refusals.
        "api_key": "A valid API key is required: send it as the header 'Authorization: Bearer <key>'.",
        "page_needs_auth": "This server was started with an API key and no logins, so it serves only programs that send "
                           "the key; its page is not offered to visitors. To offer it, its operator adds --auth "
                           "user:password, and visitors sign in.",
        "not_ready": "The model is still loading or warming up ({now}); please try again shortly (Retry-After "
                     "says when).",
        "bad_field": "The request's '{field}' is missing or not valid.",
        "image_url_off": "This server does not download images from links; send the image itself: a file, or a "
                         "data: URL (data:image/png;base64,…).",
        "image_url_blocked": "{host} is a local or private address; images are downloaded only from public addresses.",
        "image_url_failed": "Could not download the image from {host}; check the link, or send the image itself: a "
                            "file, or a data: URL.",
        # A remote engine (--backend) that did not answer.
        "backend_unreachable": "The model server cannot be reached right now. Please try again shortly.",
        "backend_timeout": "The model server did not answer in time. Please try again shortly.",
        "backend_cut": "The model server stopped in the middle of the answer. Please try again.",
        "backend_busy": "The model server is busy. Please try again shortly.",
        "backend_failed": "The model server could not answer (error {status}). Please try again shortly.",
        "backend_refused": "The model server refused this request: {message}",
        # The conversations kept in the browser (qvl/serve/history.py states the bounds).
        "conversations": "Conversations", "new_conversation": "New conversation",
        "delete_conversation": "Delete this conversation", "download_markdown": "Download as Markdown (.zip)",
        "download_json": "Download as JSON", "upload_conversation": "Upload a conversation (JSON)",
        "kept_here": "Conversations are kept in this browser only, never on the server: the newest 50, 2 MB in all, "
                     "their pictures downscaled to 1024 px (1 MB of them per conversation).",
        "not_kept": "[{count} file(s) not kept: a kept conversation holds pictures only, {limit} of them]",
        "untitled": "Pictures without a question",
        "not_a_conversation": "This file is not a conversation downloaded from this app as JSON, so nothing was "
                              "changed.",
        "md_user": "You", "md_assistant": "Assistant",
    },
    "zh-CN": {
        "title": "## 用 Qwen3-VL 聊图片（CPU 运行）",
        "fallback": "⚠ **离线后备模式**：无法加载真实模型，当前由一个微型随机模型回答，内容没有意义。",
        "warming": "⏳ 正在预热：模型还在准备中。现在提出的问题会排队，准备好后立即回答。",
        "start_reading": "正在读取模型：{done}",
        "start_converting": "正在为此 CPU 转换模型，仅首次启动需要：{done}",
        "start_loading": "正在加载模型……",
        "start_warming": "正在预热：回答第一个问题……",
        "start_connecting": "正在询问模型服务器提供哪个模型……",
        "chat": "聊天", "settings": "设置", "conversation": "对话",
        "placeholder": "关于图片提问……（回车发送，Shift+回车换行）",
        "welcome": "### 关于图片，尽管问\n\n添加一张或多张图片（上传、拖放或粘贴），输入问题后按回车。"
                   "回答由本机 CPU 实时逐字生成。\n\n也可以从这些示例开始：",
        "example_chart": "哪种水果卖得最多？比最不受欢迎的多卖了几箱？",
        "example_receipt": "这张收据的总金额是多少？哪一项最贵？",
        "example_scene": "用一句话描述这张图片。",
        "example_shapes": "框出每个红色的圆并标注：用 JSON 给出每个圆的 bbox_2d。",
        "threads": "算子内线程数（全服务器，立即生效）",
        "generation": "### 生成参数（仅对你的会话）",
        "max_image_tokens": "图片最大 token 数（越少越快，越多细节越清楚）",
        "max_video_frames": "视频最多帧数（每秒 2 帧；每两帧花费一张图片的 token）",
        "max_new_tokens": "最大生成 token 数", "temperature": "温度", "top_p": "Top-p", "top_k": "Top-k",
        "greedy": "贪心解码（结果确定；忽略温度、top-p、top-k）", "seed": "随机种子",
        "cache": "### 回答缓存", "use_cache": "重复的问题从缓存回答",
        "cache_clear": "清空缓存……", "cache_confirm": "要删除所有访客的全部缓存回答吗？",
        "cache_yes": "确定清空", "cancel": "取消", "refresh": "刷新",
        "server": "本服务器",
        "operator_only": "全服务器设置（线程数、清空缓存）仅限本服务器的管理员修改。",
        "waiting": "排队中：前面还有 {ahead} 个请求……",
        "busy": "服务器繁忙（已有 {size} 个请求在排队），请稍后再试。",
        "one_at_a_time": "你已有一个问题正在排队或回答中：请一次只问一个。等它回答完（或停止它）后再问。",
        "failed": "回答时出错，请重试。",
        "not_operator": "只有本服务器的管理员可以修改此项。",
        "stopped": "已停止",
        "drawn": "回答中的框和点，画在图片上",
        "no_answer": "（模型没有给出回答：请换个说法提问，或点“重试”再试一次）",
        "thinking": "思考过程", "thought_for": "思考 {seconds:.1f} 秒",
        "thought_cut": "（模型达到最大生成 token 数时仍在思考，所以没有给出回答：请在“设置”中调大“最大生成 token 数”后再问一次）",
        "forgotten": "⚠ 服务器已不再记得之前的消息（在您上次提问后来了很多访客），以下是一个新的对话。",
        "forgotten_asked": "⚠ 服务器在回答之前就忘记了这个对话（同时来了很多访客）：请再次发送您的问题。",
        "stats": "首个 token {ttft:.2f} 秒 · {tps:.1f} token/秒 · 图片 {image_tokens} token · "
                 "共 {total:.1f} 秒",
        "from_cache": "{elapsed:.2f} 秒内从缓存回答（首次计算用时 {total:.1f} 秒）",
        "truncated": "已达最大生成长度",
        "reused": "复用了提示中 {prompt} 个 token 里的 {tokens} 个", "features_cached": "图片特征来自缓存（{count} 张）",
        "batch_part": "与其他回答批量解码（每批 {count} 个）",
        "memory_line": "对话记忆：{state} · 保留 {entries} 段 · {size:.0f} / {limit:.0f} MB · "
                       "命中 {hits} · 已复用 {reused} 个提示 token\n\n图片特征：{features} · 命中 {feature_hits}",
        "features_line": "内存中 {memory} 个，磁盘上 {disk} 个", "memory_off": "关闭",
        "cache_line": "回答缓存：{state} · {entries} 条回答 · {size:.1f} MB · 命中 {hits} · 未命中 {misses}",
        "on": "开启", "off": "关闭", "broken": "不可用，暂不使用缓存",
        "fact_model": "模型", "fact_precision": "精度 / 量化", "fact_threads": "线程",
        "fact_threads_value": "算子内 {threads} · 算子间 {interop}（启动时固定） · 可用核心 {cores}",
        "fact_cpu": "CPU", "fact_versions": "版本", "fact_fallback": "后备原因",
        "fact_cache_dir": "回答缓存目录",
        "precision_int8": "int8：所有线性层和输出头的权重与激活均为 int8（fbgemm，每个 token 一个缩放因子），"
                          "文本中数值特别大的通道单独计算，词嵌入表为 bf16",
        "precision_w8a14": "w8a14：同 int8，但解码时每行激活拆成两个 int8 部分（14 位），前几个文本层的权重也拆成两部分",
        "precision_int4": "int4：解码时文本权重为 int4（处理提示时为 int8），视觉部分为 int8，每个 token 一个缩放因子，"
                          "文本中数值特别大的通道单独计算，词嵌入表为 bf16",
        "precision_w8a16": "w8a16：所有线性层和输出头为 int8 权重（每行一个缩放因子）配 bf16 激活，"
                           "文本中数值特别大的通道单独计算，词嵌入表为 bf16",
        "precision_remote": "由 {detail} 的模型服务器回答",
        "not_found": "{name}：找不到文件，请重新上传。",
        "empty_file": "{name} 是空文件，请上传图片（PNG、JPEG、WebP、GIF）、视频（MP4、WebM、MOV）或 PDF。",
        "not_image": "无法读取 {name}，它不是本应用能识别的图片，请上传图片（PNG、JPEG、WebP、GIF）、视频（MP4、WebM、MOV）或 PDF。",
        "damaged": "{name} 已损坏或不完整，请上传完整的图片。",
        "too_many_pixels": "{name} 有 {size} 像素；最多接受 {limit} 百万像素的图片，请先缩小。",
        "far_too_many": "过多",
        "file_too_big": "{name} 大于 {limit}，请上传更小的图片。",
        "pdf_damaged": "无法读取 PDF 文件 {name}（已损坏、不完整或根本不是 PDF），请上传完整的 PDF，或该页的图片。",
        "pdf_locked": "{name} 有密码保护，请上传没有密码的 PDF，或该页的图片。",
        "pdf_too_many_pages": "{name} 有 {pages} 页；最多接受 {limit} 页的 PDF，请只上传你要问的那几页。",
        "video_damaged": "无法读取视频 {name}（已损坏、不完整或根本不是视频），请上传完整的 MP4、WebM 或 MOV 片段。",
        "video_audio_only": "{name} 只有声音；本应用只回答关于图片和视频的问题，不处理音频。",
        "video_too_long": "{name} 长 {seconds} 秒；最多接受 {limit} 秒的视频，请剪出你要问的那一段。",
        "video_part": "视频：{frames} 帧，{tokens} token",
        "empty_question": "请输入问题或添加图片。",
        "bad_role": "未知角色 {role!r}：每一轮必须是 'system'、'user' 或 'assistant'。",
        "ends_with_user": "对话必须以用户消息结尾。",
        "too_long": "这段对话需要 {needed} 个 token{images}，超过了 {limit} 个 token 的上限。"
                    "请清空对话、发送更少或更小的图片，或在“设置”中调低“图片最大 token 数”。",
        "too_long_model": "这段对话需要 {needed} 个 token{images}，但此模型最多只能处理 {limit} 个。"
                          "请清空对话、发送更少或更小的图片，或在“设置”中调低“图片最大 token 数”。",
        "image_share": "（其中 {tokens} 个用于 {count} 张{pictures}）",
        "picture": "图片", "pictures": "图片",
        "api_key": "需要有效的 API 密钥：请在请求头中发送 'Authorization: Bearer <密钥>'。",
        "page_needs_auth": "本服务器以 API 密钥启动且未设登录，只为发送密钥的程序服务，不向访客提供页面。"
                           "如要提供页面，运营者需加上 --auth 用户名:密码，访客登录后使用。",
        "not_ready": "模型仍在加载或预热（{now}），请稍后再试（Retry-After 给出等待秒数）。",
        "bad_field": "请求中的 '{field}' 缺失或无效。",
        "image_url_off": "本服务器不从链接下载图片；请发送图片本身：文件，或 data: URL（data:image/png;base64,…）。",
        "image_url_blocked": "{host} 是本地或内网地址；只从公网地址下载图片。",
        "image_url_failed": "无法从 {host} 下载图片；请检查链接，或发送图片本身：文件，或 data: URL。",
        "backend_unreachable": "暂时无法连接模型服务器，请稍后再试。",
        "backend_timeout": "模型服务器没有及时回答，请稍后再试。",
        "backend_cut": "模型服务器在回答中途中断了，请重试。",
        "backend_busy": "模型服务器繁忙，请稍后再试。",
        "backend_failed": "模型服务器无法回答（错误 {status}），请稍后再试。",
        "backend_refused": "模型服务器拒绝了此请求：{message}",
        "conversations": "对话记录", "new_conversation": "新对话",
        "delete_conversation": "删除此对话", "download_markdown": "下载为 Markdown（.zip）",
        "download_json": "下载为 JSON", "upload_conversation": "上传对话（JSON）",
        "kept_here": "对话只保存在此浏览器中，从不保存在服务器上：最多保留最近 50 段，共 2 MB，"
                     "图片缩小到 1024 像素（每段对话的图片最多 1 MB）。",
        "not_kept": "[{count} 个文件未保存：每段保存的对话只保存图片，最多 {limit}]",
        "untitled": "没有提问的图片",
        "not_a_conversation": "此文件不是从本应用下载的 JSON 对话，未做任何更改。",
        "md_user": "你", "md_assistant": "助手",
    },
}
LANGUAGES = tuple(TEXT)


def language(request) -> str:
    """The language to answer a request in (a gr.Request), from its Accept-Language header: Chinese for zh*, else
    English."""
    accept = request.headers.get("accept-language", "") if request is not None else ""
    return "zh-CN" if (accept or "").strip().lower().startswith("zh") else "en"


def say(lang: str, key: str, **params) -> str:
    return TEXT[lang][key].format(**params)


def starting(lang: str, progress: tuple[str, float | None]) -> str:
    """What a start does now (Engine.progress()): 'Reading the model: 45%'."""
    phase, done = progress
    return say(lang, f"start_{phase}", done="…" if done is None else f"{int(done * 100)}%")


def image_share(lang: str, tokens: int, count: int) -> str:
    """ ' (300 of them for 1 image)', or '' for a conversation without images."""
    if not count:
        return ""
    return say(lang, "image_share", tokens=tokens, count=count, pictures=TEXT[lang]["picture" if count == 1 else
                                                                                   "pictures"])
